"""The simulator claims in the token log's order: the same enqueues, claims, flushes and requeues
on the real token log (a real redis-server) and on the simulator's `ClaimQueue`, then every
sample claimed one at a time from both, must give the same sequence of sample ids.

Either side changing its order fails it: the Lua score (`seq - ntok * 4294967296`, in
infra/rollout/tokenlog.py) or `infra.rollout.policies.claims.claim_score` / `claim_key`, which the
simulator's queue sorts by.
"""

from __future__ import annotations

import uuid

import pytest

from infra.rollout.controller_config import ControllerConfig
from infra.rollout.tokenlog import Claim, GroupSpec, TokenLog
from infra.sim.claiming import ClaimQueue

pytestmark = pytest.mark.integration

VERSION = 0
ROUTE_S = 600.0  # a routed sample's wait: longer than the test


class Both:
    """One token log and one simulator queue, driven through the same operations."""

    def __init__(self, log: TokenLog) -> None:
        self.log = log
        self.queue = ClaimQueue()
        self.steps: list[int] = []
        self.logged: dict[str, int] = {}
        self.epochs: dict[str, int] = {}
        self.held: dict[str, set[str]] = {}
        self.order: list[str] = []

    def enqueue_step(self, step: int, groups: int, n: int) -> None:
        specs = [GroupSpec(g, [1, 2, 3], n, 64, seed=g, sampling={"temperature": 1.0}) for g in range(groups)]
        assert self.log.enqueue_step(step, VERSION + step, specs, min_version=VERSION)
        self.steps.append(step)
        for g in range(groups):
            for i in range(n):
                sid = f"{step}/{g}/{i}"
                self.logged[sid] = 0
                self.queue.push(sid, step, self.queue.next_seq(step), 0)

    def claim(self, instance: str) -> str | None:
        """One claim of one sample by `instance`: both sides must hand out the same one."""
        claims: list[Claim] = self.log.claim(self.steps, instance, VERSION, 1)
        expected = self.queue.pop() if len(self.queue) else None
        got = claims[0].sample_id if claims else None
        assert got == expected, f"claim {len(self.order)}: the token log gave {got}, the simulator {expected}"
        if got is None:
            return None
        assert len(claims[0].generated_ids) == self.logged[got]  # it resumes from its logged tokens
        self.order.append(got)
        self.epochs[got] = claims[0].epoch
        self.held.setdefault(instance, set()).add(got)
        return got

    def generate(self, sid: str, instance: str, tokens: int) -> None:
        """`instance` flushes `tokens` more tokens of `sid`."""
        ids = [7] * tokens
        assert self.log.append(sid, instance, self.epochs[sid], ids, [-0.5] * tokens, offset=self.logged[sid])
        self.logged[sid] += tokens

    def release(self, sid: str, instance: str, *, keep: bool = True, to: str | None = None) -> None:
        assert self.log.release(sid, instance, self.epochs[sid], keep_tokens=keep, to=to, route_s=ROUTE_S)
        self.held[instance].discard(sid)
        if not keep:
            self.logged[sid] = 0
        step = int(sid.split("/")[0])
        self.queue.push(sid, step, self.queue.next_seq(step), self.logged[sid], routed=to is not None)

    def reap(self, instance: str) -> None:
        """The instance died: the token log requeues its samples in sample-id order, tokens kept."""
        held = sorted(self.held.pop(instance))
        assert self.log.reap(instance, ControllerConfig().max_reaps) == len(held)
        for sid in held:
            step = int(sid.split("/")[0])
            self.queue.push(sid, step, self.queue.next_seq(step), self.logged[sid])


@pytest.fixture
def both(redis_client) -> Both:
    return Both(TokenLog(redis_client, f"claim-order-{uuid.uuid4().hex[:8]}"))


def test_the_token_log_and_the_simulator_claim_in_the_same_order(both):
    both.enqueue_step(0, groups=3, n=4)  # 12 samples, seq 1..12
    both.enqueue_step(1, groups=2, n=3)  # a later step (bounded staleness): claimed after step 0's
    first = [both.claim("a") for _ in range(5)]
    more = [both.claim("b") for _ in range(4)]
    assert first + more == [f"0/{g}/{i}" for g in range(3) for i in range(4)][:9]  # FIFO: nothing logged
    for sid, tokens in zip(first, [5, 0, 12, 5, 3]):
        both.generate(sid, "a", tokens)
    for sid, tokens in zip(more, [9, 12, 0, 1]):
        both.generate(sid, "b", tokens)
    both.release(first[0], "a")  # 5 tokens, behind the never-claimed 0/2/1..3 by seq, ahead by score
    both.release(first[2], "a")  # 12 tokens
    both.release(first[1], "a")  # no tokens: a new seq, behind the never-claimed ones
    both.release(first[3], "a", keep=False)  # restart: its 5 tokens go, it queues as fresh
    both.release(more[0], "b", to="a")  # a steal routed to a: before the step's shared queue
    both.reap("b")  # 12, 0 and 1 tokens, requeued in sample-id order
    assert both.claim("a") == more[0]
    both.generate(more[0], "a", 4)
    # c claims the rest of step 0, then two of step 1, and generates some of them
    while not both.order[-1].startswith("1/") or sum(s.startswith("1/") for s in both.order) < 2:
        both.claim("c")
    held = sorted(both.held["c"])
    assert len(held) == 12 and held[-2:] == ["1/0/0", "1/0/1"]
    for sid, tokens in zip(held, [2, 30, 0, 7, 20, 0, 11, 1, 0, 3, 40, 50]):
        if tokens:
            both.generate(sid, "c", tokens)
    both.reap("c")
    for sid in sorted(both.held["a"]):
        both.release(sid, "a")
    # every sample is queued now: d claims them all, one at a time
    drained = [both.claim("d") for _ in range(len(both.logged))]
    assert both.claim("d") is None
    assert sorted(drained) == sorted(both.logged)
    steps = [int(sid.split("/")[0]) for sid in drained]
    assert steps == sorted(steps)  # the older step first, whatever the later one has logged
    logged = [both.logged[sid] for sid in drained if sid.startswith("0/")]
    assert logged == sorted(logged, reverse=True) and len(set(logged)) > 3  # most logged tokens first
    assert drained != sorted(drained)  # not FIFO by sample id
