"""What a CPU trainer group's agent template (`rl.distributed.group`, `rl.warm_fork`) imports before
it forks each torchrun agent: torchrun, the rank's modules and DeepSpeed (with MLflow hidden, as each
rank imports it). Each agent would otherwise import them itself, about 4 s of CPU (2-core AMD EPYC)."""

from torch.distributed import run  # noqa: F401

from rl.distributed import rank

rank.import_deepspeed()
