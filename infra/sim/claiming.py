"""The simulator's model of the token log's queues and of many workers claiming from them.

`ClaimQueue` holds every open step's queued samples in the runtime's claim order
(`infra.rollout.policies.claims.claim_key`) and numbers enqueues per step as the token log does;
`tests/infra/sim/test_claim_order.py` drives it and the real token log alike and compares.

`dispatch` stands in for the workers' own claims: at runtime no one dispatches, each worker claims
up to its free slots and Redis serialises the claims. The simulator advances every engine to the
same instant, so it needs a rule for one instant's claims: water-filling by free slots,
rollout-only instances first. What that simplifies is in docs/internals.md §11.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from infra.rollout.policies import ClusterSnapshot, eligible
from infra.rollout.policies.claims import claim_key


class ClaimQueue:
    """The token log's queues over every open step, popped in the runtime's claim order."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int, int], str, int]] = []
        """(claim key, sample id, enqueue seq)."""
        self._seq: dict[int, int] = {}
        self.partial = 0
        """Queued samples with a logged token (a negative claim score)."""

    def next_seq(self, step: int) -> int:
        """The step's next enqueue seq (the Lua's ``HINCRBY step:<step> seq 1``): at each sample of
        the step's enqueue, and at each requeue, routed or not, when it is handed back."""
        self._seq[step] = self._seq.get(step, 0) + 1
        return self._seq[step]

    def push(self, sample_id: str, step: int, seq: int, logged_tokens: int, *, routed: bool = False) -> None:
        """Queue a sample with the seq it got from `next_seq`; `routed`: in the step's routed queue
        and claimable now (its receiver claims, or its wait is over)."""
        heapq.heappush(self._heap, (claim_key(step, routed, seq, logged_tokens), sample_id, seq))
        self.partial += logged_tokens > 0

    def pop(self) -> str:
        """The sample the next claim takes."""
        key, sample_id, _ = heapq.heappop(self._heap)
        self.partial -= key[2] < 0
        return sample_id

    def rescore(self, logged_tokens: Callable[[str], int]) -> None:
        """Score every queued sample again from its logged tokens now (after a truncation)."""
        self._heap = [
            (claim_key(key[0], key[1] == 0, seq, logged_tokens(sid)), sid, seq) for key, sid, seq in self._heap
        ]
        heapq.heapify(self._heap)
        self.partial = sum(key[2] < 0 for key, _, _ in self._heap)

    def forget_step(self, step: int) -> None:
        """A trained step: its counter goes (the token log deletes the step's keys)."""
        self._seq.pop(step, None)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[str]:
        """The queued sample ids, in no particular order."""
        return (sid for _, sid, _ in self._heap)


@dataclass(frozen=True)
class DispatchDecision:
    instance_id: str
    count: int


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
