"""One rank of the DeepSpeed trainer: a process started by torchrun, driven over its channel.

`rl.distributed.group.RankGroup` launches it under torchrun (several nodes: `rl.distributed.node`
too); each rank connects to the driver's channel, joins the process group (gloo on CPU, NCCL on
GPU), answers one message at a time (`rl.distributed.protocol`) until `close` or a closed channel
(exit 3), and dies with its torchrun agent (a parent-death signal) or the driver (a watchdog).

`RankTrainer` is the torch `Trainer` over DeepSpeed: the same micro-batch loss
(`Trainer.accumulate_micro_batch`), `engine.backward` and `engine.step` (ZeRO-sharded AdamW,
clipping, the schedule). Accumulation is the caller's: at `finish` the step's divisor becomes
DeepSpeed's loss scale, so unscale-and-clip matches the torch trainer; every rank makes the same
number of passes (`rounds`; zero-weight ones on a one-token sample), as ZeRO-2/3 reduce in every
backward; `abandon` is a NaN-weighted pass that DeepSpeed skips as an overflow. With `model.lora`
ZeRO holds only the adapters' optimizer state, the KL reference is the forward with the adapters
off, state and checkpoints are the adapters (ZeRO-3 gathers just those). Detail: docs/trainers.md.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Client
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import save

from rl.config import OptimConfig, TrainerConfig
from rl.devices import TORCH_DTYPES
from rl.distributed.protocol import (
    AUTHKEY_ENV,
    CHANNEL_ENV,
    STORE_KEY,
    TrainSpec,
    batch_from_wire,
    channel_address,
)
from rl.driver_watch import EXIT_DRIVER_GONE, die_with_parent, watch_driver
from rl.env_vars import TRAINER_NODE_JOINED as JOINED_ENV
from rl.lora import adapter_state
from rl.models import load_model
from rl.process_memory import peak_rss_mb
from rl.trainer import Accumulation, TrainBatch, Trainer, write_policy

CHANNEL_WAIT_S = 600.0
"""How long a rank on another node waits for the driver's node to put the channel in the store."""
CHECKPOINT_TAG = "state"
"""DeepSpeed's tag (subdirectory) of the sharded state inside a checkpoint's `deepspeed/`."""
LINGER_S = 2.0
"""How long a rank that raised stays after reporting it, unless the driver closes its channel first.
When a peer died, this rank's collective failed because of it: torchrun (which polls its ranks every
0.1 s) then finds the dead peer alone and reports it as the cause, rather than this rank, which its
fork start method would report when both have exited (the lowest-numbered failed rank it finds)."""


def deepspeed_config(trainer: TrainerConfig, optim: OptimConfig, autocast: str | None) -> dict:
    """DeepSpeed's configuration: ZeRO at the configured stage, caller-owned accumulation,
    clipping at the torch trainer's norm; batch sizes are nominal (there is no DeepSpeed data loader).
    With bf16 autocast (`model.dtype: bf16`) its `torch_autocast` section: without it DeepSpeed's
    engine switches off the trainer's autocast inside its forward, and the ranks train in fp32."""
    mixed = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}} if autocast == "bf16" else {}
    return mixed | {
        "train_micro_batch_size_per_gpu": optim.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": optim.max_grad_norm,
        "zero_optimization": {"stage": trainer.zero_stage, "stage3_gather_16bit_weights_on_model_save": False},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class RankTrainer(Trainer):
    """The GRPO trainer of one rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, spec: TrainSpec, world_size: int) -> None:
        import deepspeed
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        super().__init__(
            model,
            spec.pad_token_id,
            spec.grpo,
            spec.optim,
            temperature=spec.temperature,
            autocast_dtype=torch.bfloat16 if spec.autocast == "bf16" else None,
            gradient_checkpointing=spec.trainer.gradient_checkpointing,
            lora=spec.lora,
        )
        self.world_size = world_size
        self.zero_stage = spec.trainer.zero_stage
        self.module = self.model
        """The policy module (with LoRA the peft model) that the engine wraps."""
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.module,
            optimizer=self.optimizer,  # the trainable parameters alone: with LoRA, the adapters
            # DeepSpeed annotates torch's deprecated `_LRScheduler`; it takes any `LRScheduler`:
            lr_scheduler=self.scheduler,  # pyright: ignore[reportArgumentType]
            config=deepspeed_config(spec.trainer, spec.optim, spec.autocast),
        )
        self.model = self.engine  # forward passes go through the engine (ZeRO-3 gathers there)
        optimizer = self.engine.optimizer
        assert isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)), (
            f"ZeRO stage {self.zero_stage} wraps the optimizer in ZeRO's, got {type(optimizer).__name__}"
        )
        self._zero_optimizer = optimizer
        """DeepSpeed's ZeRO optimizer, whose loss scale carries the step's divisor (`finish`)."""
        self._dummy = TrainBatch([[spec.pad_token_id]], [[spec.pad_token_id]], [[0.0]], [0.0])
        """A one-token sample: the pass a rank makes when it has no micro-batch of its own."""
        self._zero_optimizer.override_loss_scale(1.0)

    @property
    def adapted_module(self) -> torch.nn.Module:
        """The peft model inside the engine: its adapters are switched off for the KL reference's
        forward, which still goes through the engine."""
        return self.module

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def begin_step(self) -> None:
        self._pending = Accumulation()

    def accumulate_share(self, batch: TrainBatch | None, rounds: int) -> None:
        """This rank's share of a piece of the step, in exactly `rounds` forward/backward passes."""
        acc = self._pending
        if acc is None:
            raise RuntimeError("accumulate outside a step")
        self.model.train()
        size = self.optim_config.micro_batch_size
        for index in range(rounds):
            chunk = range(index * size, min((index + 1) * size, len(batch) if batch else 0))
            if not (batch and len(chunk) and self.accumulate_micro_batch(batch, chunk, acc)):
                self.accumulate_micro_batch(self._dummy, range(1), acc, scale=0.0)
        self.model.eval()

    def finish(self, weight: float) -> dict:
        """The optimizer step; `weight` is the whole step's divisor (over every rank). Returns this
        rank's metric sums, the gradient norm and the learning rate it stepped with."""
        acc = self._pending
        self._pending = None
        self._zero_optimizer.override_loss_scale(weight / self.world_size)
        try:
            self.engine.step()
        finally:
            self._zero_optimizer.override_loss_scale(1.0)
        lr = self.optimizer.param_groups[0]["lr"]  # after the scheduler's step, as the torch trainer reports it
        norm = self.engine.get_global_grad_norm()
        norm = float("inf") if norm is None else float(norm)
        if math.isfinite(norm):  # else DeepSpeed skipped the update as an overflow
            self.step += 1
        sums = {"weighted": {}, "per_token": {}}
        if acc is not None:
            for group in ("weighted", "per_token"):
                sums[group] = {k: float(v) for k, v in getattr(acc, group).items()}
        return {**sums, "grad_norm": norm, "lr": lr, "peak_rss_mb": peak_rss_mb()}

    def abandon(self) -> None:
        """Drop the step's accumulated gradients on every rank; the policy is unchanged."""
        self._pending = Accumulation()
        self.model.train()
        self.accumulate_micro_batch(self._dummy, range(1), self._pending, scale=float("nan"))
        self.model.eval()
        self.engine.step()  # an overflow: skipped, gradients cleared, no scheduler step
        self._pending = None

    def full_state(self, dtype: torch.dtype | None, rank: int) -> dict[str, torch.Tensor] | None:
        """The policy on rank 0: every weight, or with LoRA the adapter tensors alone (under ZeRO-3
        gathered from every rank: with LoRA only the adapters are gathered); None on other ranks."""
        if self.zero_stage != 3:
            return self._cast_state(dtype) if rank == 0 else None
        import deepspeed

        parameters = list(self.module.parameters())
        if self.lora is not None:
            parameters = [p for p in parameters if p.requires_grad]  # the adapters
        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
            return self._cast_state(dtype) if rank == 0 else None

    def _cast_state(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        state = {}
        policy = adapter_state(self.module) if self.lora is not None else self.module.state_dict()
        for name, tensor in policy.items():
            tensor = tensor.detach()
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            state[name] = tensor.to("cpu").contiguous().clone()
        return state

    def save(self, directory: Path, rank: int) -> None:
        """Every rank writes its shard of the optimizer state; rank 0 also the policy
        (`rl.trainer.write_policy`: the full weights, or with LoRA a PEFT adapter directory). With
        LoRA DeepSpeed's own files leave the frozen base out."""
        policy = self.full_state(None, rank)
        if policy is not None:
            write_policy(directory, policy, self.lora)
        self.engine.save_checkpoint(
            str(directory / "deepspeed"),
            tag=CHECKPOINT_TAG,
            client_state={"step": self.step},
            save_latest=False,
            exclude_frozen_parameters=self.lora is not None,
        )

    def load(self, directory: Path) -> int:
        """Restore what `save` wrote (the driver has checked the checkpoint's kind); returns its step."""
        path, client = self.engine.load_checkpoint(
            str(directory / "deepspeed"),
            tag=CHECKPOINT_TAG,
            load_module_strict=self.lora is None,  # with LoRA the frozen base is not in the checkpoint
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if path is None or client is None:
            raise FileNotFoundError(f"no DeepSpeed state under {directory / 'deepspeed'}")
        self.step = int(client["step"])
        return self.step


def _init_process_group(spec: TrainSpec) -> torch.device:
    deepspeed = import_deepspeed()
    _without_the_shared_memory_op()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=spec.trainer.collective_timeout_s))
    return device


def import_deepspeed() -> ModuleType:
    """DeepSpeed, imported with MLflow hidden: its autotuner imports MLflow (and pandas with it)
    whenever it is installed, about 1 s of CPU in every rank, for autotuning runs the ranks never
    make; hidden from that one import, it reads MLflow as absent. A later `import mlflow` works."""
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # pyright: ignore[reportArgumentType]  # None: "not installed"
    try:
        import deepspeed
    finally:
        if hide:  # nothing can have imported MLflow while it was hidden
            del sys.modules["mlflow"]
    return deepspeed


SHARED_MEMORY_OP = "deepspeed_shm_comm"


def _without_the_shared_memory_op() -> None:
    """DeepSpeed's communication backend loads its shared-memory op when the process group starts:
    on CPU it probes every op with the compiler and JIT-compiles this one (60-110 s on a fresh
    2-core machine, under a lock file that a stopped compile used to leave behind) for
    `inference_all_reduce` alone, which training never calls. Marked incompatible (DeepSpeed keeps
    the list it reads as a module attribute for such edits), the backend skips it and reduces
    through the process group (gloo, NCCL), as it does wherever the op cannot be built."""
    import deepspeed.ops

    # A module attribute DeepSpeed computes on first access (its module `__getattr__`): no stub.
    setattr(deepspeed.ops, "__compatible_ops__", {SHARED_MEMORY_OP: False})  # noqa: B010


def serve(conn, rank: int, world_size: int) -> int:
    """Answer the driver's messages until `close` (returns 0) or a closed channel (the driver is
    gone: returns `EXIT_DRIVER_GONE`, so that an agent on another node reports a failed group)."""
    op, spec = conn.recv()
    if op != "init":
        raise RuntimeError(f"expected init, got {op!r}")
    spec = TrainSpec.model_validate(spec)
    threads = spec.trainer.threads_per_rank or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    device = _init_process_group(spec)
    model, _ = load_model(spec.model_path, spec.gguf_file)
    # transformers' `@wraps(Module.to)` hides the method's binding from the type checker:
    trainer = RankTrainer(model.to(device), spec, world_size)  # pyright: ignore[reportArgumentType]
    conn.send(("ok", {"rank": rank, "device": str(device), "threads": threads}))
    print(f"rlboost trainer rank {rank} (pid {os.getpid()}) ready on {device}, {threads} threads", flush=True)
    while True:
        try:
            op, payload = conn.recv()
        except EOFError:
            return EXIT_DRIVER_GONE  # the driver closed the channel (or died): nothing to hand back
        if op == "close":
            conn.send(("ok", None))
            return 0
        conn.send(("ok", _handle(trainer, op, payload, rank)))


def _handle(trainer: RankTrainer, op: str, payload, rank: int):
    if op == "begin":
        trainer.begin_step()
        return None
    if op == "accumulate":
        batch = batch_from_wire(payload["batch"]) if payload["batch"] else None
        trainer.accumulate_share(batch, payload["rounds"])
        return None
    if op == "finish":
        return trainer.finish(payload["weight"])
    if op == "abandon":
        trainer.abandon()
        return None
    if op == "state":
        dtype = TORCH_DTYPES[payload["dtype"]] if payload["dtype"] else None
        state = trainer.full_state(dtype, rank)
        return None if state is None else save(state)
    if op == "save":
        trainer.save(Path(payload["directory"]), rank)
        return None
    if op == "load":
        return trainer.load(Path(payload["directory"]))
    raise ValueError(f"unknown message {op!r}")


AGENTS = ("rl.distributed.agent", "torch.distributed.run", "torchrun")
"""What the command line of a rank's parent, its torchrun agent, names."""


def _is_agent(pid: int) -> bool:
    """Whether `pid` is a torchrun agent (True where its command line cannot be read)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True
    return any(agent in command for agent in AGENTS)


def _channel() -> tuple[str, str, bool]:
    """(address, key hex, whether this rank runs on the driver's node). The driver's node has them
    in its environment; with a TCP channel (several nodes) its ranks put them in torchrun's store,
    where the other nodes' ranks wait for them."""
    if CHANNEL_ENV in os.environ:
        address, key = os.environ[CHANNEL_ENV], os.environ[AUTHKEY_ENV]
        if not address.startswith("/"):
            _store().set(STORE_KEY, json.dumps([address, key]))
        return address, key, True
    address, key = json.loads(_store().get(STORE_KEY))
    return address, key, False


def _store():
    """A client (a `torch.distributed.TCPStore`) of torchrun's store, the one the process group starts from."""
    # torch documents `torch.distributed.TCPStore`; its stubs re-export it without `__all__`:
    return torch.distributed.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=CHANNEL_WAIT_S),
    )


def main() -> int:
    die_with_parent(_is_agent)  # a rank never outlives its agent (e.g. killed while the ranks wait for the driver)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    watch_driver(lambda: print(f"rank {rank}: the training process is gone; exiting", flush=True), grace_s=0.0)
    address, key, local = _channel()
    conn = Client(channel_address(address), authkey=bytes.fromhex(key))
    node = {
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "host": socket.gethostname(),
        "local": local,
        "world_size": world_size,
        "agent": os.getppid(),
    }
    conn.send(("hello", rank, os.getpid(), node))
    if os.environ.get(JOINED_ENV):  # started by `rlboost trainer-node`: it is in a group now
        Path(os.environ[JOINED_ENV]).touch()
    try:
        return serve(conn, rank, world_size)
    except BaseException:
        text = traceback.format_exc()
        print(f"rank {rank} failed:\n{text}", file=sys.stderr, flush=True)
        try:
            conn.send(("error", text))
            conn.poll(LINGER_S)  # returns at once when the driver closes the channel
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
