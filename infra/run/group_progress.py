"""How a step's rollout reports its complete groups while it runs (the `rollout` task's progress
artifact in the Prefect UI): throttled, because each report is an API call, and only for a rollout
long enough to watch. A demo step's rollout (about a second) made three artifact calls a step,
which cost more than the progress they showed.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class GroupProgress:
    """Counts complete groups; calls `report(done, total)` once the rollout has run `every_s`, then
    at most once per `every_s` and for the last group. A rollout shorter than `every_s` reports
    nothing."""

    def __init__(
        self,
        total: int,
        report: Callable[[int, int], None] | None,
        every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.report, self.every_s, self.clock = total, report, every_s, clock
        self.done = 0
        self.reported = False
        self._last = clock()

    def advance(self) -> None:
        self.done += 1
        if self.report is None:
            return
        now = self.clock()
        if now - self._last >= self.every_s or (self.reported and self.done == self.total):
            self._last, self.reported = now, True
            self.report(self.done, self.total)

    def finish(self) -> None:
        """The rollout ended: a rollout that reported says where it ended (groups may have been
        dropped)."""
        if self.report is not None and self.reported and self.done != self.total:
            self.report(self.done, self.total)
