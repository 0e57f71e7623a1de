"""Adaptive rollout offload: the per-step time budget `T_local` during which reserved instances
also generate, before they release their unfinished samples to spot instances and train.

Update rule per step (docs/internals.md §5): ``T_local += (trainer_idle - rollout_idle) / damping``,
clamped to ``[floor, ceiling]``. ``trainer_idle`` (the trainer waited for complete groups after the
release: spot rollout was the bottleneck) makes `T_local` grow; ``rollout_idle`` (the fleet had no
work left and waited for the next version: training was the bottleneck) makes it shrink.

On top of the rule the controller hill-climbs on throughput, remembering per spot count the best
`T_local` seen (a move that lowered throughput is reverted and later moves halved); §5 has the
details. With no spot instance alive the reserved cluster never releases: it finishes the step.
It also keeps the **throughput curve**: a moving average of step throughput per spot count, from
the steps whose spot count stayed the same throughout (`observe`; 0: the reserved cluster alone),
which marginal fleet sizing reads (`infra.rollout.policies.marginal`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

CURVE_WEIGHT = 0.3
"""Weight of the newest step in the throughput curve's moving average per spot count."""
CURVE_WARMUP_STEPS = 2
"""The first steps ever observed at a spot count are left out of its average: `T_local` is not
yet tuned for the count and would undersell it (0 has no `T_local`: neither warm-up nor minimum)."""
CURVE_MIN_STEPS = 3
"""Steps after the warm-up a spot count needs before the curve shows it."""


@dataclass(frozen=True)
class StepTiming:
    """What one finished step measured, as inputs to `OffloadController.update`."""

    t_local_s: float
    """The `T_local` in force when the reserved cluster released (`t_local(num_spot)`)."""
    trainer_idle_s: float
    rollout_idle_s: float
    throughput: float
    """The objective, e.g. trained tokens per second of wall time; higher is better."""
    num_spot: int
    """Spot (rollout-only) instances alive during the step."""

    def __post_init__(self) -> None:
        if self.trainer_idle_s < 0 or self.rollout_idle_s < 0:
            raise ValueError("idle times must be >= 0")


@dataclass(frozen=True)
class _Memory:
    best_t_local: float
    best_throughput: float
    scale: float
    """Multiplier of the rule's move for this spot count, in (0, 1]."""


class OffloadController:
    """Chooses `T_local` per step; persistable with `to_dict` / `from_dict`."""

    def __init__(self, initial_t_local: float, floor: float, ceiling: float | None, damping: float) -> None:
        """The `controller.offload` settings (`infra.rollout.controller_config.OffloadSettings.new_controller`)."""
        if damping <= 0:
            raise ValueError(f"damping must be > 0, got {damping}")
        if not floor <= initial_t_local <= (math.inf if ceiling is None else ceiling):
            raise ValueError(f"need floor <= initial_t_local <= ceiling, got {floor}, {initial_t_local}, {ceiling}")
        self.floor = floor
        self.ceiling = ceiling
        self.damping = damping
        self._t_local = initial_t_local
        self._last_num_spot: int | None = None
        self._memory: dict[int, _Memory] = {}
        self._curve: dict[int, tuple[float, int]] = {}
        """Spot count -> (moving average of throughput, steps observed)."""

    def t_local(self, num_spot: int) -> float:
        """`T_local` for a step with `num_spot` spot instances: the current value while the spot
        count is the one of the last update (or has no memory), else the best remembered for it."""
        memory = self._memory.get(num_spot)
        if memory is None or num_spot == self._last_num_spot:
            return self._t_local
        return memory.best_t_local

    def should_release(self, now: float, step_started_at: float, num_spot_alive: int) -> bool:
        """Whether reserved instances must release their samples and train now. Never while no
        spot instance is alive; evaluate it continuously, since it turns False again if the last
        spot instance dies, and the reserved cluster then resumes rollout (no deadlock)."""
        return num_spot_alive > 0 and now - step_started_at >= self.t_local(num_spot_alive)

    def update(self, timing: StepTiming) -> float:
        """Learn from a finished step; returns the new current `T_local`. A step without spot
        instances never released, so it teaches nothing and leaves the state unchanged."""
        n = timing.num_spot
        if n == 0:
            return self._t_local
        used, throughput = timing.t_local_s, timing.throughput
        memory = self._memory.get(n)
        revert = False
        if memory is None:
            memory = _Memory(used, throughput, 1.0)
        elif math.isclose(used, memory.best_t_local, abs_tol=1e-9):
            memory = replace(memory, best_throughput=throughput)
        elif throughput >= memory.best_throughput:
            memory = _Memory(used, throughput, min(1.0, memory.scale * 2))
        else:
            memory = replace(memory, scale=memory.scale / 2)
            revert = True
        self._memory[n] = memory
        move = (timing.trainer_idle_s - timing.rollout_idle_s) / self.damping
        self._t_local = self._clamp(memory.best_t_local if revert else used + move * memory.scale)
        self._last_num_spot = n
        return self._t_local

    def observe(self, num_spot: int, throughput: float) -> None:
        """Fold a step's throughput into the curve at `num_spot`; only for a step whose spot
        count was `num_spot` throughout (one that gained or lost an instance would credit the
        count with what a partly absent instance did). `T_local` is unchanged."""
        old, steps = self._curve.get(num_spot, (throughput, 0))
        fresh = num_spot > 0 and steps <= CURVE_WARMUP_STEPS  # the warm-up's steps, and the first after it
        self._curve[num_spot] = (throughput if fresh else old + CURVE_WEIGHT * (throughput - old), steps + 1)

    def throughput_curve(self) -> dict[int, float]:
        """Step throughput per spot count: a moving average (`CURVE_WEIGHT`) of the steps at it
        after `CURVE_WARMUP_STEPS`, for the counts with `CURVE_MIN_STEPS` such steps."""
        shown = CURVE_WARMUP_STEPS + CURVE_MIN_STEPS
        return {n: value for n, (value, steps) in self._curve.items() if n == 0 or steps >= shown}

    def _clamp(self, t_local: float) -> float:
        t_local = max(self.floor, t_local)
        return t_local if self.ceiling is None else min(self.ceiling, t_local)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable state."""
        return {
            "t_local": self._t_local,
            "floor": self.floor,
            "ceiling": self.ceiling,
            "damping": self.damping,
            "last_num_spot": self._last_num_spot,
            "memory": {str(n): asdict(m) for n, m in self._memory.items()},
            "curve": {str(n): list(entry) for n, entry in self._curve.items()},
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> OffloadController:
        controller = cls(state["t_local"], state["floor"], state["ceiling"], state["damping"])
        controller._last_num_spot = state["last_num_spot"]
        controller._memory = {int(n): _Memory(**m) for n, m in state["memory"].items()}
        controller._curve = {int(n): (float(v), int(k)) for n, (v, k) in state.get("curve", {}).items()}
        return controller
