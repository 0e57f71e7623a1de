"""Training on complete groups while the rollout's tail is still generating (docs/internals.md §4).

GRPO normalises advantages within a group, so a group can be scored and its gradient accumulated
as soon as its n responses are done. `StreamedStep` is the trainer's side of that: `add` takes each
complete group (from one thread at a time) and scores it; once complete groups fill a micro-batch
(`optim.micro_batch_size` samples; one per rank for `rl.distributed`) it calls `accumulate`.
`finish` checks it saw exactly the step's groups with the step's own advantages, then takes the
optimizer step: the update equals one `Trainer.train_step` on the whole batch up to float summation
order; `abandon` drops it. With `optim.updates_per_step` > 1 the updates need the whole step (the
proximal forward comes first), so `add` only scores and `finish` hands every sample over in the
step's order. One RL step is one policy version; groups the rollout dropped are never added.
`train_batch` is the one way samples become a `TrainBatch`: their logged token ids and loss masks.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

import torch

from rl.config import GRPOConfig
from rl.datasets import PromptRecord
from rl.rewards import RewardFn
from rl.rollout import Sample
from rl.scoring import score_group
from rl.trainer import PolicyTrainer, TrainBatch


def train_batch(samples: Sequence[Sample], advantages: Sequence[float]) -> TrainBatch:
    """The batch of `samples`: their token ids as logged (never decoded and re-encoded), the
    engine's log-probs and each one's loss mask (a trajectory's environment segments: 0)."""
    return TrainBatch(
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        [s.logprobs for s in samples],
        list(advantages),
        [s.loss_mask for s in samples] if any(s.loss_mask for s in samples) else [],
    )


class StreamedStep:
    """One RL step's gradient, accumulated group by group as the rollout completes them."""

    def __init__(
        self,
        trainer: PolicyTrainer,
        records: Sequence[PromptRecord],
        tokenizer,
        reward_fn: RewardFn,
        correctness_fn: RewardFn,
        grpo: GRPOConfig,
    ) -> None:
        self.trainer = trainer
        self.records = records
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.correctness_fn = correctness_fn
        self.grpo = grpo
        self.advantages: dict[str, float] = {}
        """Advantage of every sample accumulated so far, by sample id."""
        self.groups = 0
        self.busy_s = 0.0
        """Seconds spent scoring and accumulating (overlapped with the rollout's tail)."""
        self._lock = threading.Lock()
        self._pending: list[tuple[Sample, float]] = []
        """Scored samples not yet accumulated: they wait for a full micro-batch."""
        self._torch_threads = torch.get_num_threads()
        """The intra-op threads of the thread that began the step (the trainer's): `add` runs in
        the rollout's consumer thread, and with torch's OpenMP backend a new thread starts with
        the count some other thread set last (a co-located engine's thread sets 1)."""
        self._streams = trainer.optim_config.updates_per_step == 1
        """Whether groups are accumulated as they come (else all at `finish`, in the step's order)."""
        trainer.begin_step()

    def add(self, samples: Sequence[Sample]) -> None:
        """Score one complete group and accumulate its gradient."""
        started = time.perf_counter()
        if torch.get_num_threads() != self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        with self._lock:
            group = samples[0].group
            if any(s.group != group for s in samples):
                raise ValueError(
                    f"a streamed group holds one prompt's samples; got groups {[s.group for s in samples]}"
                )
            scores = score_group(
                list(samples), self.records[group], self.tokenizer, self.reward_fn, self.correctness_fn, self.grpo
            )
            self._pending.extend(zip(samples, scores.advantages))
            if self._streams and len(self._pending) >= self.trainer.samples_per_accumulate:
                self._accumulate_pending()
            self.advantages.update((s.sample_id, a) for s, a in zip(samples, scores.advantages))
            self.groups += 1
            self.busy_s += time.perf_counter() - started

    def _accumulate_pending(self) -> None:
        """Accumulate the scored samples waiting for a full micro-batch (one forward/backward of
        a full micro-batch costs about as much as one of a single group on a small model)."""
        if self._pending:
            samples, advantages = zip(*self._pending)
            self._pending.clear()
            self.trainer.accumulate(train_batch(samples, advantages))

    def covers(self, samples: Sequence[Sample]) -> bool:
        """Whether exactly these samples were accumulated (a retried rollout may differ)."""
        return sorted(s.sample_id for s in samples) == sorted(self.advantages)

    def finish(self, samples: Sequence[Sample], advantages: Sequence[float]) -> dict[str, float]:
        """Take the optimizer step, after checking that the accumulated samples and their
        advantages are those of the step's batch (`samples`, `advantages`)."""
        if not self.covers(samples):
            raise ValueError(
                f"streamed {len(self.advantages)} samples but the step has {len(samples)}: "
                "train the batch with Trainer.train_step instead"
            )
        for sample, advantage in zip(samples, advantages):
            if not math.isclose(self.advantages[sample.sample_id], advantage, rel_tol=1e-5, abs_tol=1e-6):
                raise RuntimeError(
                    f"sample {sample.sample_id}: streamed advantage {self.advantages[sample.sample_id]} "
                    f"differs from the step's {advantage}"
                )
        with self._lock:
            if not self._streams:
                order = {sample.sample_id: index for index, sample in enumerate(samples)}
                self._pending.sort(key=lambda pending: order[pending[0].sample_id])
            self._accumulate_pending()
        return self.trainer.finish_step()

    def abandon(self) -> None:
        """Drop the accumulated gradient (the policy is unchanged)."""
        self._pending.clear()
        self.trainer.abandon_step()
