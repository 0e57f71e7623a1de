"""`DistributedTrainer`: the GRPO trainer as a group of DeepSpeed ranks, with the torch
`Trainer`'s interface, so the training session and `rl.streaming.StreamedStep` drive either.

It lives in the training process and holds no model: each `accumulate` splits its samples across
the ranks by tokens (`rl.distributed.split`) and sends each rank its share; `finish_step` sends the
step's divisor (its tokens or sequences, counted here exactly as the torch trainer counts them)
and combines the ranks' metric sums into the same metrics. `policy_state()` gathers the whole
policy once per version, in the engines' dtype, from rank 0 (`rl.distributed.rank`); with
`model.lora` (`TrainSpec.lora`) the policy is the adapter tensors alone.

Checkpoints: every rank writes its shard of the ZeRO state under the checkpoint's `deepspeed/`
(DeepSpeed's own checkpointing) and rank 0 the policy (`model.safetensors`, or with LoRA a PEFT
adapter directory); `rl.checkpoint` adds the driver's RNG and data cursor. A checkpoint resumes on
the same world size, ZeRO stage and `model.lora` (or its absence); another one fails before any
rank is sent anything, with what to set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load
from torch import Tensor

from rl.config import GRPOConfig, OptimConfig, TrainerConfig
from rl.distributed.group import RankGroup
from rl.distributed.protocol import TrainSpec, batch_to_wire
from rl.distributed.split import TokenBalancer, rounds
from rl.grpo import objective_of
from rl.lora import ADAPTER_WEIGHTS_FILE
from rl.trainer import WEIGHTS_FILE, CheckpointMismatch, TrainBatch, check_lora_matches, lora_record


@dataclass
class _StepTotals:
    tokens: float = 0.0
    sequences: float = 0.0
    weight: float = 0.0


def check_supported(optim: OptimConfig) -> None:
    """Raise ValueError (one line) for what the DeepSpeed trainer (`trainer.backend: deepspeed`)
    does not do: more than one optimizer update per RL step (its ranks accumulate one per step)."""
    if optim.updates_per_step > 1:
        raise ValueError(
            f"optim.updates_per_step={optim.updates_per_step} is not supported with trainer.backend: deepspeed "
            "(its ranks take one update per RL step): set optim.updates_per_step: 1 or trainer.backend: torch"
        )


class DistributedTrainer:
    """A DeepSpeed trainer of `trainer.world_size` ranks (see the module docstring)."""

    def __init__(
        self,
        spec: TrainSpec,
        log_path: Path,
        state_dtype: str | None = None,
        environment: dict[str, str] | None = None,
        rendezvous_id: str = "rlboost",
    ) -> None:
        """`state_dtype`: dtype of `policy_state()` (the engines'); `environment`: extra variables of the ranks;
        `rendezvous_id`: with `trainer.nodes` > 1, torchrun's rendezvous id (the run's name), the
        `--run-id` of every `rlboost trainer-node`.

        Refuses `optim.updates_per_step` > 1 before starting any rank (see `check_supported`)."""
        check_supported(spec.optim)
        self.spec = spec
        self.config: TrainerConfig = spec.trainer
        self.grpo: GRPOConfig = spec.grpo
        self.optim_config: OptimConfig = spec.optim
        self.state_dtype = state_dtype
        self.step = 0
        self._pending: _StepTotals | None = None
        self._balancer = TokenBalancer(self.config.world_size)
        self._state: tuple[int, dict[str, Tensor]] | None = None
        env = dict(environment or {})
        on_cpu = torch.device(spec.device).type == "cpu"
        if on_cpu:
            env.setdefault("DS_ACCELERATOR", "cpu")
        self.group = RankGroup(
            self.config.world_size,
            log_path,
            self.config.start_timeout_s,
            env,
            self.config.reply_timeout_s,
            nodes=self.config.nodes,
            rendezvous=self.config.rendezvous,
            rendezvous_id=rendezvous_id,
            channel_host=self.config.channel_host,
            channel_port=self.config.channel_port,
            fork_ranks=on_cpu and self.config.fork_ranks,
        )
        try:
            self.ranks = self.group.start(spec.model_dump(mode="json"))
        except BaseException:
            self.group.close()
            raise

    @property
    def samples_per_accumulate(self) -> int:
        """One micro-batch per rank."""
        return self.optim_config.micro_batch_size * self.config.world_size

    @property
    def accumulating(self) -> bool:
        return self._pending is not None

    @property
    def objective(self) -> str:
        """What the ranks' `policy_loss` computes (`auto` counted as `grpo`, as `Trainer.objective`)."""
        return objective_of(self.grpo.objective)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        if not len(batch):
            raise ValueError("empty TrainBatch")
        self.begin_step()
        self.accumulate(batch)
        return self.finish_step()

    def begin_step(self) -> None:
        if self._pending is not None:
            self.abandon_step()
        self.group.call("begin")
        self._balancer.reset()
        self._pending = _StepTotals()

    def accumulate(self, batch: TrainBatch) -> None:
        """Split `batch` by tokens and add each share's gradient on its rank."""
        totals = self._pending
        if totals is None:
            raise RuntimeError("accumulate() outside a step: call begin_step() first")
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        shares = self._balancer.split(lengths)
        passes = rounds(shares, self.optim_config.micro_batch_size)
        payloads = [
            {"batch": batch_to_wire(batch.select(share)) if share else None, "rounds": passes} for share in shares
        ]
        self.group.call("accumulate", payloads)
        # Counted as the torch trainer counts them (a micro-batch without tokens adds nothing).
        size = self.optim_config.micro_batch_size
        for share in shares:
            for start in range(0, len(share), size):
                rows = share[start : start + size]
                tokens = float(batch.trained_tokens(rows))
                sequences = float(sum(1 for i in rows if any(batch.mask(i))))
                totals.tokens += tokens
                totals.sequences += sequences
                totals.weight += tokens if self.grpo.aggregation == "token" else sequences

    def finish_step(self) -> dict[str, float]:
        totals = self._pending
        if totals is None:
            raise RuntimeError("finish_step() outside a step: call begin_step() first")
        if totals.tokens == 0:
            self.abandon_step()
            raise ValueError("the step has no response tokens to train on")
        self._pending = None
        replies = self.group.call("finish", [{"weight": totals.weight}] * self.config.world_size)
        norm = replies[0]["grad_norm"]
        if not math.isfinite(norm):
            raise FloatingPointError(f"non-finite gradient norm at step {self.step}; update skipped")
        self.step += 1
        weighted = _sum(reply["weighted"] for reply in replies)
        per_token = _sum(reply["per_token"] for reply in replies)
        metrics = {key: value / totals.weight for key, value in weighted.items()}
        metrics.update((key, value / totals.tokens) for key, value in per_token.items())
        metrics.update(grad_norm=norm, lr=replies[0]["lr"], response_tokens=totals.tokens)
        metrics["peak_rss_mb"] = max(reply["peak_rss_mb"] for reply in replies)
        return metrics

    def abandon_step(self) -> None:
        """Drop the accumulated step on every rank (the policy is unchanged)."""
        self._pending = None
        self.group.call("abandon")

    def policy_state(self) -> dict[str, Tensor]:
        """The policy at version `step` (with LoRA its adapter tensors), gathered once per version from
        rank 0 in `state_dtype`."""
        if self._state is None or self._state[0] != self.step:
            blob = self.group.call("state", [{"dtype": self.state_dtype}] * self.config.world_size)[0]
            self._state = (self.step, load(blob))
        return self._state[1]

    def save_state(self, directory: Path) -> dict:
        self.group.call("save", [{"directory": str(directory)}] * self.config.world_size)
        return {
            "backend": "deepspeed",
            "world_size": self.config.world_size,
            "zero_stage": self.config.zero_stage,
            "lora": lora_record(self.spec.lora),
            "step": self.step,
        }

    def load_state(self, directory: Path, state: dict) -> None:
        backend = state.get("backend", "torch")
        if backend != "deepspeed":
            raise CheckpointMismatch(
                f"checkpoint {directory} was written by the torch trainer; this run has trainer.backend: deepspeed. "
                "Resume it with trainer.backend=torch (one process), or start a new run"
            )
        check_lora_matches(directory, state, self.spec.lora)
        if (state["world_size"], state["zero_stage"]) != (self.config.world_size, self.config.zero_stage):
            kind, policy_file = (
                ("weights", WEIGHTS_FILE) if self.spec.lora is None else ("adapters", ADAPTER_WEIGHTS_FILE)
            )
            raise CheckpointMismatch(
                f"checkpoint {directory} holds ZeRO-{state['zero_stage']} optimizer state sharded over "
                f"{state['world_size']} ranks; this run has trainer.world_size={self.config.world_size} and "
                f"trainer.zero_stage={self.config.zero_stage}. Resume it with --set trainer.world_size="
                f"{state['world_size']} --set trainer.zero_stage={state['zero_stage']}, or start a new run "
                f"(its {kind} alone are in {directory / policy_file})"
            )
        steps = self.group.call("load", [{"directory": str(directory)}] * self.config.world_size)
        if len(set(steps)) != 1 or steps[0] != state["step"]:
            raise RuntimeError(f"checkpoint {directory}: the ranks restored steps {steps}, expected {state['step']}")
        self.step = state["step"]
        self._state = None

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        self.group.close()


def _sum(dicts) -> dict[str, float]:
    total: dict[str, float] = {}
    for d in dicts:
        for key, value in d.items():
            total[key] = total.get(key, 0.0) + value
    return total
