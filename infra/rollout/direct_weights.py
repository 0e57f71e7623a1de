"""Policy versions handed to a rollout worker in the same process, with no network pull.

A co-located instance (`infra.run.colocated`) runs its `RolloutWorker` inside the training process:
the trainer `offer`s each version it publishes, and the worker `take`s the version its current
step needs at the point where another worker would pull it (holding no running sample). Only the
latest offer is kept. It holds the trainer's tensors themselves, not a copy: the engine copies them
into its own weights when it loads them, and the trainer changes them only at its next optimizer
step, which waits for every group of the step the worker is loading this version for.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any


class DirectWeights:
    """The latest version the trainer offered; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version: int | None = None
        self._state: Mapping[str, Any] | None = None

    def offer(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Make `version` the one a worker takes (replacing any older offer)."""
        with self._lock:
            self._version, self._state = version, state_dict

    @property
    def version(self) -> int | None:
        """The version offered last, None before the first offer."""
        with self._lock:
            return self._version

    def take(self, version: int) -> Mapping[str, Any] | None:
        """The state dict of `version` if it is the one offered, else None (not offered yet)."""
        with self._lock:
            return self._state if self._version == version else None
