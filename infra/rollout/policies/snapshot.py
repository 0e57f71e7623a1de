"""The state snapshot every controller policy reads: instances, the step and its queue, at one
clock value.

The Redis runtime builds a snapshot from the registry and the token log; the simulator builds one
from its event state. Policies never see anything else, so both drive identical decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.availability.capacity import CapacityClass

"""`reserved` instances also train; `ondemand` and `spot` instances only generate."""


@dataclass(frozen=True)
class RunningSample:
    """One sample an instance is generating now."""

    sample_id: str
    tokens_generated: int
    """Tokens generated so far, logged prefix included."""
    budget: int
    """Maximum response length in tokens."""
    turns: int = 0
    """Model turns of a trajectory completed so far, each answered by its environment (0: a
    single-turn sample, or a trajectory in its first turn)."""
    max_turns: int = 1
    """Its environment's `max_turns` (1: a single-turn sample)."""
    awaiting_env: bool = False
    """A trajectory whose turn ended and waits for its environment's answer (a tool call): it
    decodes nothing now, however much budget it has left."""

    @property
    def remaining(self) -> int:
        """Tokens still allowed: an upper bound on what is left to generate."""
        return max(0, self.budget - self.tokens_generated)

    @property
    def turns_left(self) -> int:
        """Model turns it may still run, the current one included (at least 1)."""
        return max(1, self.max_turns - self.turns)


@dataclass(frozen=True)
class InstanceView:
    """One registered rollout instance as the registry last saw it."""

    instance_id: str
    pool: str
    capacity_class: CapacityClass
    policy_version: int | None
    """Version of the weights it has loaded; None while it has none."""
    slots: int
    """Samples it can generate concurrently."""
    running: tuple[RunningSample, ...]
    last_heartbeat: float
    """Clock value of its last heartbeat (same clock as `ClusterSnapshot.now`)."""
    alive: bool = True
    """False once it has been reaped or has deregistered."""
    draining: bool = False
    """True after a preemption notice or an eviction order: it takes no new work."""
    price_per_hour: float = 0.0
    steal_requested_at: float | None = None
    """Clock value of the last steal request sent to it, if any."""

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - len(self.running))

    @property
    def decoding(self) -> int:
        """Running samples it decodes now (not waiting for their environment)."""
        return sum(1 for s in self.running if not s.awaiting_env)

    @property
    def rollout_only(self) -> bool:
        """Spot and on-demand instances: the ones that take over after `T_local`."""
        return self.capacity_class != "reserved"


@dataclass(frozen=True)
class QueueView:
    """The step's queued (unowned) samples."""

    queued: int
    queued_partial: int = 0
    """How many of `queued` already have logged tokens (released or migrated samples)."""


@dataclass(frozen=True)
class StepView:
    """Progress of the current RL step."""

    step: int
    policy_version: int
    """The version every sample of this step is generated with (on-policy)."""
    started_at: float
    total_samples: int
    done: int
    groups_total: int
    groups_done: int


@dataclass(frozen=True)
class ClusterSnapshot:
    """Everything the policies may look at, taken at clock value `now`."""

    now: float
    step: StepView
    instances: tuple[InstanceView, ...]
    queue: QueueView

    def can_generate(self, instance: InstanceView) -> bool:
        """Alive, not draining, and holding the step's policy version."""
        return instance.alive and not instance.draining and instance.policy_version == self.step.policy_version

    @property
    def rollout_only_alive(self) -> int:
        """Spot and on-demand instances that are alive and not draining: the offload targets."""
        return sum(1 for i in self.instances if i.rollout_only and i.alive and not i.draining)
