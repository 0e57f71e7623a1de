"""Heartbeat eviction: declare dead the instances whose heartbeat has lapsed, so the controller
releases their samples (the epoch bump fences the zombie) instead of waiting for a broken socket.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.rollout.policies.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class ReaperConfig:
    timeout_s: float
    """An instance silent for longer than this is dead (`controller.reap_timeout_s`: a few heartbeat
    intervals)."""


@dataclass(frozen=True)
class ReapDecision:
    instance_id: str
    reason: str
    """Human-readable, e.g. ``no heartbeat for 45.0 s (timeout 30.0 s)``."""


def reap(snapshot: ClusterSnapshot, config: ReaperConfig) -> tuple[ReapDecision, ...]:
    """Alive instances whose last heartbeat is more than `timeout_s` before `snapshot.now`,
    sorted by `instance_id`. Instances already dead are not reported again."""
    decisions = []
    for instance in sorted(snapshot.instances, key=lambda i: i.instance_id):
        silent = snapshot.now - instance.last_heartbeat
        if instance.alive and silent > config.timeout_s:
            reason = f"no heartbeat for {silent:.1f} s (timeout {config.timeout_s:.1f} s)"
            decisions.append(ReapDecision(instance.instance_id, reason))
    return tuple(decisions)
