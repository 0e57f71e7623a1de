"""Token-level load balancing: when the queue is empty, ask heavily loaded instances to release
some running samples so that idle slots elsewhere pick them up from their logged prefix. A
trajectory counts by its turns left and is never taken while it waits for its environment.

Each decision names its receiver: the token log routes the released samples to it
(`TokenLog.release(..., to=...)`), so the instance the balance was computed for is the one that
continues them, not whichever instance claims first; after `StealConfig.route_s` without that
claim (the receiver died or stopped claiming) any instance may take them.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.rollout.control import ROUTE_S
from infra.rollout.policies.claims import active
from infra.rollout.policies.snapshot import ClusterSnapshot, InstanceView, RunningSample


@dataclass(frozen=True)
class StealConfig:
    min_keep: int = 1
    """Running samples a victim always keeps."""
    min_gap: int = 2
    """Move a sample only while the victim runs at least this many more samples than the
    receiver; below 2 a move does not reduce the imbalance."""
    min_remaining_tokens: int = 128
    """Samples with less remaining budget finish soon and are never stolen: the re-prefill on
    the receiver would cost more than it saves."""
    cooldown_s: float = 5.0
    """An instance asked to release is not asked again for this long (hysteresis: its release
    must show up in the snapshot before it is judged again)."""
    route_s: float = ROUTE_S
    """A stolen sample waits this long (on the Redis server's clock) for the receiver it was
    stolen for to claim it; after that any instance may (the receiver died or stopped claiming)."""

    def __post_init__(self) -> None:
        if self.min_keep < 0 or self.min_gap < 1 or self.cooldown_s < 0 or self.route_s <= 0:
            raise ValueError("need min_keep >= 0, min_gap >= 1, cooldown_s >= 0 and route_s > 0")


@dataclass(frozen=True)
class StealDecision:
    """Ask `from_instance` to flush and release `sample_ids`, routed to `to_instance`."""

    from_instance: str
    sample_ids: tuple[str, ...]
    to_instance: str

    @property
    def count(self) -> int:
        return len(self.sample_ids)


def _stealable(instance: InstanceView, config: StealConfig) -> list[RunningSample]:
    """Candidates, most turns left first (a trajectory's later turns are work its budget alone
    does not show), then most remaining budget, never cutting into the `min_keep` decoding samples
    it keeps. A trajectory waiting for its environment is never one: it decodes nothing there, and
    moving it would move its pending tool call."""
    candidates = sorted(
        (s for s in instance.running if s.remaining >= config.min_remaining_tokens and not s.awaiting_env),
        key=lambda s: (-s.turns_left, -s.remaining, s.sample_id),
    )
    return candidates[: max(0, instance.decoding - config.min_keep)]


def steal(snapshot: ClusterSnapshot, config: StealConfig, *, reserved_released: bool) -> tuple[StealDecision, ...]:
    """Steal decisions for this snapshot; none while any sample is queued.

    Receivers are the instances that may claim (`claims.eligible`: free slots, alive, not
    draining, on the step's version). Victims are active instances outside their cooldown. One
    sample at a time moves from the most loaded victim to the least loaded receiver (ties by
    `instance_id`) while their decoding counts (running samples not waiting for their environment)
    differ by at least `min_gap`; an instance is never both victim and receiver. The total stolen
    never exceeds the receivers' free slots. One decision per
    (victim, receiver) pair, sorted by both.
    """
    if snapshot.queue.queued > 0:
        return ()
    now = snapshot.now
    live = [i for i in snapshot.instances if active(snapshot, i, reserved_released=reserved_released)]
    load = {i.instance_id: i.decoding for i in live}
    room = {i.instance_id: i.free_slots for i in live if i.free_slots > 0}
    pool = {
        i.instance_id: _stealable(i, config)
        for i in live
        if i.steal_requested_at is None or now - i.steal_requested_at >= config.cooldown_s
    }
    taken: dict[tuple[str, str], list[str]] = {}
    gave: set[str] = set()
    while True:
        victims = [v for v, left in pool.items() if left]
        if not victims:
            break
        victim = min(victims, key=lambda v: (-load[v], v))
        receivers = [r for r, free in room.items() if free > 0 and r != victim and r not in gave]
        if not receivers:
            break
        receiver = min(receivers, key=lambda r: (load[r], r))
        if load[victim] - load[receiver] < config.min_gap:
            break
        taken.setdefault((victim, receiver), []).append(pool[victim].pop(0).sample_id)
        gave.add(victim)
        load[victim] -= 1
        load[receiver] += 1
        room[receiver] -= 1
        pool.pop(receiver, None)
    return tuple(StealDecision(v, tuple(ids), r) for (v, r), ids in sorted(taken.items()))
