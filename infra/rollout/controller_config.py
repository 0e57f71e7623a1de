"""The rollout controller's configuration: `fabric.controller` of a run, `controller` of a scenario.

Runtime-free (pydantic and the pure policies only), so that loading a configuration, `rlboost
--help` and the simulator import neither redis, numpy nor the token log. The controller runtime
that reads it is `infra.rollout.controller.RolloutController`.
"""

from __future__ import annotations

from pydantic import Field

from infra.rollout.policies import OffloadController, StealConfig
from rl.config import Section


class OffloadSettings(Section):
    """Adaptive offload: how long reserved instances generate per step (`T_local`)."""

    initial_t_local_s: float = Field(default=60.0, ge=0)
    """`T_local` of the first step, before any step has been measured."""
    floor_s: float = Field(default=0.0, ge=0)
    """`T_local` never drops below this."""
    ceiling_s: float | None = Field(default=None, ge=0)
    """`T_local` never exceeds this; None for no limit."""
    damping: float = Field(default=3.0, gt=0)
    """Divisor of the per-step move ``trainer_idle - rollout_idle``."""

    def new_controller(self) -> OffloadController:
        return OffloadController(self.initial_t_local_s, self.floor_s, self.ceiling_s, self.damping)


class ControllerConfig(Section):
    """The rollout controller's policies and polling."""

    reap_timeout_s: float = Field(default=30.0, gt=0)
    """An instance whose heartbeat is older than this is dead: its samples are reaped."""
    steal: StealConfig = StealConfig()
    """Token-level load balancing (`infra.rollout.policies.steal`)."""
    offload: OffloadSettings = OffloadSettings()
    """Adaptive `T_local`; used until a step's measurements are persisted in Redis."""
    poll_s: float = Field(default=0.5, gt=0)
    """Longest wait between two polls (a completed group wakes the controller at once)."""
    max_reaps: int = Field(default=3, ge=1)
    """Attempts per sample: one whose owner was reaped this many times fails (its group is
    dropped), since it may be what kills instances."""
