"""One tracker's sender thread (`Channel`) and what it sends (`Op`s).

The training thread only appends to a bounded buffer (`put`: never blocks, never raises); the
channel's thread hands the buffered ops, oldest first and in batches, to the tracker's `send`, at
most once every `interval_s` (a tracker's server pays most of its cost per request: a local MLflow
server spent 17 ms of CPU on a request of 40 metrics, 110 ms on one of 800). A
`send` that raises (a server gone) logs one warning, keeps the ops and retries every `retry_s`
until it succeeds (one line when it does) or the channel closes; an op that finds the buffer full,
and any still buffered when the channel closes, is dropped and counted (`dropped`). `flush` (the
run's end) waits for the buffer to empty, retrying a failing tracker every `HURRY_S`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rlboost.tracking")

HURRY_S = 0.5
"""The retry interval of a failing tracker while the run's end waits for it."""
SEND_INTERVAL_S = 2.0
"""The least time between two sends of a channel (what is put meanwhile goes in the next); the
run's end (`flush`, `close`) does not wait for it."""


@dataclass(frozen=True)
class Metrics:
    step: int
    values: Mapping[str, float]


@dataclass(frozen=True)
class Params:
    values: Mapping[str, str]


@dataclass(frozen=True)
class Artifact:
    path: Path
    """A file to attach (the curves PNG)."""


@dataclass(frozen=True)
class Text:
    name: str
    """What the text is (`final_checkpoint`): a text artifact, a TensorBoard text, a W&B summary key."""
    text: str


@dataclass(frozen=True)
class Finish:
    """The run is over: end the tracker's run (a resumed run reopens it)."""


Op = Metrics | Params | Artifact | Text | Finish


class Channel:
    """The buffer and thread that feed one tracker's `send(ops)`; `put` from any thread."""

    def __init__(
        self,
        name: str,
        send: Callable[[Sequence[Op]], None],
        *,
        capacity: int = 10_000,
        retry_s: float = 5.0,
        interval_s: float = SEND_INTERVAL_S,
    ) -> None:
        self.name, self._send, self.capacity, self.retry_s = name, send, capacity, retry_s
        self.interval_s = interval_s
        self._next_send = 0.0
        """When the thread may send again (`time.monotonic()`): `interval_s` after the last send."""
        self._pending: deque[Op] = deque()
        self._changed = threading.Condition()
        self._closing = self._abandoned = self._hurry = False
        self.sent = self.dropped = self.failures = 0
        self.failing = False
        self._thread = threading.Thread(target=self._run, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def put(self, op: Op) -> None:
        """Buffer `op` for the thread; drop it (counted) when the buffer is full or the channel closed."""
        with self._changed:
            if self._closing or len(self._pending) >= self.capacity:
                self.dropped += 1
                return
            self._pending.append(op)
            self._changed.notify_all()

    def flush(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the buffer to empty, a failing tracker retried every
        `HURRY_S` meanwhile (the run's end: its server may be coming back)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._hurry = True
            self._changed.notify_all()
            while self._pending and time.monotonic() < deadline:
                self._changed.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            self._hurry = False

    def close(self, timeout_s: float) -> None:
        """Send what is buffered within `timeout_s` (one more try if failing), then stop; what is
        left is dropped and counted."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._closing = True
            self._changed.notify_all()
            while self._pending and time.monotonic() < deadline:
                self._changed.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            self._abandoned = True
            self.dropped += len(self._pending)
            self._pending.clear()
            self._changed.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._abandoned and not self._closing:
                    self._changed.wait()
                while not (self._abandoned or self._closing or self._hurry) and time.monotonic() < self._next_send:
                    self._changed.wait(self._next_send - time.monotonic())  # more ops join the batch
                if self._abandoned or not self._pending:
                    return
                batch = list(self._pending)
                self._next_send = time.monotonic() + self.interval_s
            try:
                self._send(batch)
            except Exception as error:  # any failure of the tracker's library: never the run's
                self._failed(error)
                continue
            with self._changed:
                for _ in range(min(len(batch), len(self._pending))):
                    self._pending.popleft()
                self.sent += len(batch)
                if self.failing:
                    log.warning("tracker %s: reachable again, sent %d buffered entries", self.name, len(batch))
                self.failing = False
                self._changed.notify_all()

    def note_failure(self, error: Exception) -> None:
        """Count a failure of the tracker; the first of a series logs the one warning."""
        with self._changed:
            self.failures += 1
            if not self.failing:
                log.warning(
                    "tracker %s failed (%s: %s); training goes on, its entries are buffered (up to %d) and "
                    "retried every %g s",
                    self.name,
                    type(error).__name__,
                    str(error).splitlines()[0][:300] if str(error) else "",
                    self.capacity,
                    self.retry_s,
                )
            self.failing = True
            self._changed.notify_all()

    def _failed(self, error: Exception) -> None:
        self.note_failure(error)
        with self._changed:
            retry_at = time.monotonic() + self.retry_s
            while not (self._closing or self._hurry) and time.monotonic() < retry_at:  # a put does not hasten it
                self._changed.wait(max(0.0, retry_at - time.monotonic()))
            if (self._closing or self._hurry) and not self._abandoned:
                self._changed.wait(HURRY_S)  # flushing or closing: try again soon, until they give up
