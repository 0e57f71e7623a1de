"""Experiment trackers (`tracking:`): MLflow, TensorBoard and W&B runs of an rl-train run.

`config` holds the configuration models (runtime-free); `preflight` checks a run's trackers before
any work; `fanout.Trackers` is what the flow calls (each step's metrics, the parameters, the
artifacts), each tracker (`mlflow_tracker`, `tensorboard_tracker`, `wandb_tracker`) fed by its own
`channel.Channel` thread, so a tracker that fails never fails or slows training. The libraries are
optional extras, imported only by the tracker modules, when a run configures them.
"""
