"""What the training process and its trainer ranks say to each other (`rl.distributed.group`,
`rl.distributed.rank`): the channel's environment names, `TrainSpec` and the batches' wire form.

The channel is a `multiprocessing.connection` over a Unix socket in a private (0700) directory,
authenticated by a random key; address and key reach the ranks in their environment (with the
driver's pid, `rl.driver_watch`); with several nodes it is TCP, and the other nodes' ranks read it
from torchrun's store (`STORE_KEY`). After a hello (rank, pid, node, host), a message is ``(op,
payload)`` of plain values, a reply ``("ok", value)`` or ``("error", traceback)``; no tensor
travels but the policy, as safetensors bytes. Each message goes to every rank and every rank answers (op: payload -> reply):
``init``: `TrainSpec` as a dict -> ``{"rank", "device", "threads"}``; ``begin``, ``abandon``,
``close``: None -> None; ``accumulate``: ``{"batch": wire batch | None, "rounds": n}`` -> None;
``finish``: ``{"weight": w}`` (the step's divisor) -> metric sums, ``grad_norm``, ``lr``;
``state``: ``{"dtype": "bf16" | ... | None}`` -> safetensors bytes of the policy (with LoRA the
adapters) on rank 0, else None; ``save`` / ``load``: ``{"directory": path}`` -> None / the restored
step. Processes and faults: docs/internals.md §2, docs/trainers.md.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from rl import env_vars
from rl.config import GRPOConfig, LoraSettings, OptimConfig, TrainerConfig
from rl.trainer import TrainBatch

CHANNEL_ENV = env_vars.TRAINER_CHANNEL
AUTHKEY_ENV = env_vars.TRAINER_AUTHKEY
STORE_KEY = "rlboost/trainer-channel"
"""The key under which torchrun's store holds the channel's ``[address, key hex]`` (several nodes)."""


def channel_address(value: str) -> str | tuple[str, int]:
    """The channel's address as `multiprocessing.connection` takes it: a Unix socket's path (it
    starts with ``/``) as is, ``host:port`` as ``(host, port)``."""
    if value.startswith("/"):
        return value
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class TrainSpec(BaseModel):
    """Everything a rank needs to build its trainer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path
    gguf_file: str | None = None
    device: str
    autocast: str | None = None
    """``"bf16"`` for bf16 autocast (mixed precision), None for fp32."""
    pad_token_id: int
    temperature: float
    grpo: GRPOConfig
    optim: OptimConfig
    trainer: TrainerConfig
    lora: LoraSettings | None = None
    """`model.lora`: the ranks train these adapters on the frozen base (None: every weight)."""


def batch_to_wire(batch: TrainBatch) -> dict:
    return {
        "prompt_ids": batch.prompt_ids,
        "response_ids": batch.response_ids,
        "rollout_logprobs": batch.rollout_logprobs,
        "advantages": batch.advantages,
        "loss_masks": batch.loss_masks,
    }


def batch_from_wire(data: dict) -> TrainBatch:
    return TrainBatch(
        data["prompt_ids"], data["response_ids"], data["rollout_logprobs"], data["advantages"], data["loss_masks"]
    )
