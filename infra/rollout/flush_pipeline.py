"""Pipelined token-log flushes (docs/internals.md §4: "flush every k tokens or t ms, pipelined").

A rollout worker collects the flushes due after an engine step and `submit`s them as one batch;
the `TokenLog.log` round trip runs on the pipeline's thread while the worker runs the next engine
step, so logging costs the engine almost nothing. At most one batch is in flight:

* `submit` first `settle`s the batch before it, so batches apply in order and a sample is never in
  two batches at once (each flush starts at the offset where the accepted ones ended);
* `settle` waits for the batch in flight and runs its callback with the per-flush results on the
  caller's thread, so the callback may update the caller's state without locks;
* if the round trip raised (Redis unavailable), `settle` re-raises and the callback never runs:
  the caller's buffers are untouched and the same tokens are sent again later, exactly once,
  because every flush carries its offset.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from infra.rollout.tokenlog import Flush, TokenLog

OnFlushed = Callable[[list[bool]], None]
"""Receives one accepted/rejected flag per flush of the batch, in order."""


class FlushPipeline:
    """One background `TokenLog.log` round trip at a time, applied in submission order."""

    def __init__(self, tokenlog: TokenLog) -> None:
        self._tokenlog = tokenlog
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-flush")
        self._in_flight: tuple[Future[list[bool]], OnFlushed] | None = None

    @property
    def busy(self) -> bool:
        """Whether a batch is submitted and not yet settled."""
        return self._in_flight is not None

    def submit(self, flushes: Sequence[Flush], on_flushed: OnFlushed) -> None:
        """Settle the previous batch, then start this one's round trip in the background."""
        self.settle()
        if flushes:
            future = self._thread.submit(self._tokenlog.log, list(flushes))
            self._in_flight = (future, on_flushed)

    def settle(self) -> None:
        """Wait for the batch in flight (if any) and run its callback here; re-raise its error."""
        if self._in_flight is None:
            return
        future, on_flushed = self._in_flight
        self._in_flight = None
        on_flushed(future.result())

    def close(self) -> None:
        """Wait for the batch in flight without applying it, and stop the thread."""
        self._in_flight = None
        self._thread.shutdown(wait=True)
