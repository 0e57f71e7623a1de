"""Pipelined token flushing: a background thread ships batches of flushes to the token log, so the
generation loop never waits on a Redis round trip.

Batches are applied in submission order (one `TokenLog.log` call each, one round trip); each
`submit` returns a future of the per-flush accept/reject flags, which the caller inspects later
(a rejection means the lease was revoked: stop generating that sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from infra.tokenlog import Flush, TokenLog


class BackgroundFlusher:
    def __init__(self, log: TokenLog) -> None:
        self._log = log
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-flusher")

    def submit(self, flushes: Sequence[Flush]) -> Future[list[bool]]:
        return self._executor.submit(self._log.log, list(flushes))

    def close(self) -> None:
        """Wait for every submitted batch to be applied."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> BackgroundFlusher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
