"""How many weight bytes one rollout instance pulls per hour: `WeightUpdates`, from `UpdateMeter`.

The publisher tells the meter each version it encodes and its bytes (a delta on the version
before, or a whole version; with LoRA, the adapters). `updates()` averages the bytes of the recent
versions after the first (the first, whole, version is what every instance pulls once when it
starts, a warm-up, not a rate; until another is measured it stands for them) and their spacing.
The capacity manager prices one instance's pulls per hour with it (docs/internals.md §3).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MEASURED_VERSIONS = 8
"""Recent versions whose bytes and spacing `UpdateMeter.updates()` averages."""


@dataclass(frozen=True)
class WeightUpdates:
    """What one instance that keeps up with the trainer pulls."""

    bytes_per_version: float
    """Mean encoded bytes of the recent versions after the first (the first's while it is alone)."""
    versions_per_hour: float
    """New versions per hour at the recent versions' pace (0 while one version is published)."""

    @property
    def bytes_per_hour(self) -> float:
        return self.bytes_per_version * self.versions_per_hour


class UpdateMeter:
    """The bytes and times of the versions encoded (thread-safe: the encoder writes, any thread reads)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._first_bytes: int | None = None
        self._later_bytes: deque[int] = deque(maxlen=MEASURED_VERSIONS)
        self._times: deque[float] = deque(maxlen=MEASURED_VERSIONS + 1)

    def encoded(self, nbytes: int) -> None:
        """A version of `nbytes` encoded bytes was encoded now."""
        with self._lock:
            if self._first_bytes is None:
                self._first_bytes = nbytes
            else:
                self._later_bytes.append(nbytes)
            self._times.append(self._clock())

    def updates(self) -> WeightUpdates | None:
        """The recent versions' mean bytes and pace; None before the first version is encoded."""
        with self._lock:
            if self._first_bytes is None:
                return None
            later, times = list(self._later_bytes), list(self._times)
        nbytes = sum(later) / len(later) if later else float(self._first_bytes)
        span = times[-1] - times[0]
        return WeightUpdates(nbytes, (len(times) - 1) * 3600 / span if span > 0 else 0.0)
