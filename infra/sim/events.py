"""A minimal discrete-event loop: callbacks at simulated times, run in time order.

Events at the same time run in the order they were scheduled (a sequence number breaks ties), so
a run is deterministic. Cancelling is done by the caller (a stale event checks its own token).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    """Simulated clock plus a heap of `(time, sequence, callback)`."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._sequence = itertools.count()

    def at(self, t: float, callback: Callable[[], None]) -> None:
        """Run `callback` at simulated time `t` (never in the past)."""
        if t < self.now:
            raise ValueError(f"cannot schedule at {t} before now ({self.now})")
        heapq.heappush(self._heap, (t, next(self._sequence), callback))

    def after(self, delay: float, callback: Callable[[], None]) -> None:
        self.at(self.now + max(0.0, delay), callback)

    def run(self, until: Callable[[], bool]) -> None:
        """Run events in order until `until()` holds after one, or no event is left."""
        while self._heap and not until():
            t, _, callback = heapq.heappop(self._heap)
            self.now = t
            callback()
