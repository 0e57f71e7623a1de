"""The run's books: what no step's cost holds, as named lines that add up with the steps to the total.

A step's cost is its usage rows (instance-seconds x price) plus the egress of its transfers; the
rest of the run's total goes to one `CostLine` each (`LINES`): instance time before the first step,
between steps (also per step: `Books.idle_after`, the gap after each step), after the last step,
in a step not yet ended, inside ended steps but not in their usage rows, and egress not tied to a
recorded step. Instance time is split on the steps' windows (an ended step: start to end; one not
ended: start to `as_of`), so the steps and the lines sum to the run's total up to float rounding.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel

from infra.ledger.models import Step
from infra.ledger.reader import RunRecords

SECONDS_PER_HOUR = 3600.0
LINES = {
    "before_step_1": (
        "before step 1",
        "instances up before the first step started: boots, model loads, the base evaluation",
    ),
    "between_steps": (
        "between steps",
        "instances up between a step's end and the next one's start: evaluations, checkpoints, orchestration",
    ),
    "after_last_step": (
        "after the last step",
        "instances up after the last step ended: the final evaluation, drains, shutdown",
    ),
    "step_in_progress": (
        "step in progress",
        "instances up in a step that has not ended (its usage is recorded when it ends)",
    ),
    "in_steps_not_in_usage": (
        "in steps, not in usage",
        "instance time inside ended steps that their usage rows leave out (negative: counted twice)",
    ),
    "egress_outside_steps": ("egress outside steps", "weight-transfer egress not tied to a recorded step"),
}
"""Each line's key: (its name in tables, what it holds)."""


class CostLine(BaseModel):
    """One part of a run's total that no step's cost holds."""

    key: str
    """The line's key in `LINES` (and `unattributed_<key>_usd` in the summary)."""
    name: str
    usd: float
    instance_seconds: float
    """The instance-seconds it bills (0 for egress; negative where usage rows count time twice)."""
    what: str


@dataclass(frozen=True)
class Books:
    lines: list[CostLine]
    idle_after: dict[int, float]
    """USD of the instance time between each step's end and the next step's start."""


def _window_end(ended_at: datetime | None, started_at: datetime, as_of: datetime) -> float:
    return (ended_at or max(as_of, started_at)).timestamp()


def _labels(windows: list[tuple[float, float, Step]], boundaries: list[float]) -> list[tuple[str, Step | None]]:
    """The line of each interval between consecutive `boundaries` (and the step it follows, between steps)."""
    labels: list[tuple[str, Step | None]] = []
    for lo, hi in zip(boundaries, boundaries[1:]):
        mid = (lo + hi) / 2
        covering = [s for a, b, s in windows if a < mid < b]
        if any(s.ended_at is not None for s in covering):
            labels.append(("in_steps", None))
        elif covering:
            labels.append(("step_in_progress", None))
        else:
            labels.append(("between_steps", max((w for w in windows if w[1] <= lo), key=lambda w: w[1])[2]))
    return labels


def books(records: RunRecords, rates: Mapping[str, float], as_of: datetime) -> Books:
    """The lines of `records` (instances priced at `rates`, USD per hour, by instance id)."""
    windows = [(s.started_at.timestamp(), _window_end(s.ended_at, s.started_at, as_of), s) for s in records.steps]
    boundaries = sorted({t for lo, hi, _ in windows for t in (lo, hi)})
    labels = _labels(windows, boundaries)
    usd: dict[str, float] = defaultdict(float)
    seconds: dict[str, float] = defaultdict(float)
    idle_after: dict[int, float] = defaultdict(float)
    for instance in records.instances:
        rate = rates[instance.instance_id] / SECONDS_PER_HOUR
        start, end = instance.launched_at.timestamp(), (instance.terminated_at or as_of).timestamp()
        inside = boundaries[bisect_right(boundaries, start) : bisect_left(boundaries, end)]
        cuts = [start, *inside, end]
        for lo, hi in zip(cuts, cuts[1:]):
            if hi <= lo:
                continue
            index = bisect_right(boundaries, (lo + hi) / 2) - 1
            if index < 0:
                key, previous = "before_step_1", None
            elif index >= len(labels):
                key, previous = "after_last_step", None
            else:
                key, previous = labels[index]
            if previous is not None:
                idle_after[previous.step] += (hi - lo) * rate
            usd[key] += (hi - lo) * rate
            seconds[key] += hi - lo
    ended_steps = {s.step for s in records.steps if s.ended_at is not None}
    for row in records.usage:
        key = "in_steps" if row.step in ended_steps else "step_in_progress"
        usd[key] -= row.seconds * rates[row.instance_id] / SECONDS_PER_HOUR
        seconds[key] -= row.seconds
    usd["in_steps_not_in_usage"], seconds["in_steps_not_in_usage"] = (
        usd.pop("in_steps", 0.0),
        seconds.pop("in_steps", 0.0),
    )
    steps = {s.step for s in records.steps}
    usd["egress_outside_steps"] = sum(t.egress_usd for t in records.transfers if t.step not in steps)
    lines = [
        CostLine(key=key, name=name, usd=usd[key], instance_seconds=seconds[key], what=what)
        for key, (name, what) in LINES.items()
    ]
    return Books(lines, dict(idle_after))
