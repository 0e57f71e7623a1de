"""Claiming: which instances may take queued samples now, and in which order the token log hands
them out (docs/internals.md §4).

`claim_score` is the Python statement of the score the token log's Lua gives a queued sample
(``requeue`` in infra/rollout/lua/prelude.lua: ``seq - ntok * 4294967296``; a step's enqueue
scores ``seq``, no tokens being logged). `claim_key` states the whole order of one claim
(claim.lua): the open steps oldest first; within a step the routed queue (``qr``: a
steal's samples whose receiver is claiming, or whose wait is over) before the shared one
(``q``); within a queue the lowest score. The simulator orders its queue by `claim_key`;
`tests/infra/sim/test_claim_order.py` checks that the real token log claims in the same order.
"""

from __future__ import annotations

from infra.rollout.policies.snapshot import ClusterSnapshot, InstanceView

SEQ_LIMIT = 2**32
"""The Lua's multiplier: an enqueue seq must stay below it, or a sample would pass one with a
logged token more."""
TOKENS_LIMIT = 2**21
"""Logged tokens stay below it, so that every score lies within +-2**53: exact in the float64
score of a Redis sorted set."""


def claim_score(enqueue_seq: int, logged_tokens: int) -> int:
    """The token log's score of a queued sample: lowest is claimed first.

    More logged tokens first (the longest partial sample is the step's tail, and resuming it
    loses nothing), then FIFO by `enqueue_seq`: the step's enqueue counter, 1.. for its samples
    in enqueue order, and the next value at every requeue (release, reap, steal).
    """
    if not 0 <= enqueue_seq < SEQ_LIMIT:
        raise ValueError(f"enqueue_seq must be in [0, 2**32), got {enqueue_seq}")
    if not 0 <= logged_tokens < TOKENS_LIMIT:
        raise ValueError(f"logged_tokens must be in [0, 2**21), got {logged_tokens}")
    return enqueue_seq - logged_tokens * SEQ_LIMIT


def claim_key(step: int, routed: bool, enqueue_seq: int, logged_tokens: int) -> tuple[int, int, int]:
    """Sort key of a queued sample in one claim over every open step: lowest is claimed first.

    Oldest step first (instances pass their open steps oldest first), then the step's routed
    samples (`routed`: in ``qr``, claimable by this instance) before its shared queue, then
    `claim_score`.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return (step, 0 if routed else 1, claim_score(enqueue_seq, logged_tokens))


def active(snapshot: ClusterSnapshot, instance: InstanceView, *, reserved_released: bool) -> bool:
    """Whether `instance` may generate samples of the current step now (free slots or not)."""
    if reserved_released and not instance.rollout_only:
        return False
    return snapshot.can_generate(instance)


def eligible(snapshot: ClusterSnapshot, instance: InstanceView, *, reserved_released: bool) -> bool:
    """Whether `instance` may claim samples of the current step now."""
    return active(snapshot, instance, reserved_released=reserved_released) and instance.free_slots > 0
