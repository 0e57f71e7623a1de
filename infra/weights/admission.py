"""`UploadSlots`: how many chunks a server uploads at once, and who goes next.

A server has `slots` concurrent uploads. A request that finds them all busy waits, and a freed
slot goes to the waiting request with the best priority, ranked when the slot frees: first the
request for the chunk this server has started uploading the fewest times, so a seed (the trainer)
sends every chunk once before it sends any twice and its uplink, the scarce one, only carries
bytes nobody else can serve yet; then the puller that already holds the least of the version, so
pullers behind catch up and all finish together (each serves its chunks as soon as it has them, so
nobody needs to be finished first to help); then the puller that started first. A request still
waiting after `timeout` seconds is refused (the server answers 503 and the puller asks again, or
elsewhere).

Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

Priority = tuple[float, float, float]
"""Smaller first: (uploads of the chunk begun so far, bytes the puller already holds, unix time its
pull started)."""


def priority(uploads_begun: int, progress_bytes: int, pull_started: float) -> Priority:
    return (float(uploads_begun), float(progress_bytes), pull_started)


class UploadSlots:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._free = slots
        self._waiting: dict[asyncio.Future[None], tuple[Callable[[], Priority], int]] = {}
        self._arrivals = itertools.count()

    @property
    def busy(self) -> int:
        return self.slots - self._free

    async def acquire(self, rank: Callable[[], Priority], timeout: float) -> bool:
        """Take a slot (True), or give up after `timeout` seconds (False). Release it after use.
        `rank()` is this request's priority, asked again each time a slot frees."""
        if self._free and not self._waiting:
            self._free -= 1
            return True
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[granted] = (rank, next(self._arrivals))
        try:
            await asyncio.wait_for(asyncio.shield(granted), timeout)
            return True
        except TimeoutError:
            return self._withdraw(granted)
        except asyncio.CancelledError:
            if self._withdraw(granted):
                self.release()
            raise

    def _withdraw(self, granted: asyncio.Future[None]) -> bool:
        """Stop waiting; True if the slot was handed over in the meantime (the caller owns it)."""
        self._waiting.pop(granted, None)
        if granted.done():
            return True
        granted.cancel()
        return False

    def release(self) -> None:
        if self._waiting:
            best = min(self._waiting, key=lambda waiter: (self._waiting[waiter][0](), self._waiting[waiter][1]))
            del self._waiting[best]
            best.set_result(None)
            return
        self._free += 1
