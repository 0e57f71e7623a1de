"""Dispatch (late binding): how many queued samples each instance may claim now, and the order
in which the token log hands queued samples out.

An instance receives work only when it has free slots, is alive, is not draining and holds the
step's policy version; reserved instances receive none once the step is past `T_local`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from infra.rollout.policies.snapshot import ClusterSnapshot, InstanceView

_TIER = float(2**50)
"""Score offset of fresh samples over partial ones; `enqueue_seq` must stay below it."""


@dataclass(frozen=True)
class DispatchDecision:
    instance_id: str
    count: int


def priority(tokens_logged: int, enqueue_seq: int) -> float:
    """Claim score of a queued sample in the token log: lowest is claimed first.

    Partially generated samples (`tokens_logged > 0`) come before fresh ones, since they are the
    step's tail; within each tier the order is FIFO by `enqueue_seq`. Scores are exact float64
    integers, so they survive a Redis sorted set unchanged.
    """
    if not 0 <= enqueue_seq < _TIER:
        raise ValueError(f"enqueue_seq must be in [0, 2**50), got {enqueue_seq}")
    return float(enqueue_seq) if tokens_logged > 0 else _TIER + enqueue_seq


def active(snapshot: ClusterSnapshot, instance: InstanceView, *, reserved_released: bool) -> bool:
    """Whether `instance` may generate samples of the current step now (free slots or not)."""
    if reserved_released and not instance.rollout_only:
        return False
    return snapshot.can_generate(instance)


def eligible(snapshot: ClusterSnapshot, instance: InstanceView, *, reserved_released: bool) -> bool:
    """Whether `instance` may claim samples of the current step now."""
    return active(snapshot, instance, reserved_released=reserved_released) and instance.free_slots > 0


def dispatch(snapshot: ClusterSnapshot, *, reserved_released: bool) -> tuple[DispatchDecision, ...]:
    """Share the queued samples among eligible instances, one sample at a time.

    Rollout-only (spot, on-demand) instances are served before reserved ones, because a sample
    given to a reserved instance migrates again at `T_local`. Within a class each next sample goes
    to the instance with the most free slots left (water-filling, which evens out batch sizes);
    ties go to the smaller `instance_id`. `reserved_released` is `OffloadController.should_release`
    for this step. Decisions are sorted by `instance_id` and have `count > 0`.
    """
    heap = [
        (0 if i.rollout_only else 1, -i.free_slots, i.instance_id)
        for i in snapshot.instances
        if eligible(snapshot, i, reserved_released=reserved_released)
    ]
    heapq.heapify(heap)
    counts: dict[str, int] = {}
    for _ in range(snapshot.queue.queued):
        if not heap:
            break
        rank, neg_free, instance_id = heapq.heappop(heap)
        counts[instance_id] = counts.get(instance_id, 0) + 1
        if neg_free < -1:
            heapq.heappush(heap, (rank, neg_free + 1, instance_id))
    return tuple(DispatchDecision(i, c) for i, c in sorted(counts.items()))
