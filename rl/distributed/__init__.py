"""The DeepSpeed trainer: a long-lived group of ranks the training process drives over a local
channel (`trainer.backend: deepspeed`). `trainer` is the driver's interface, `group` launches and
watches the ranks, `rank` is each rank's process, `protocol` their messages, `split` the
token-balanced split of samples across ranks."""
