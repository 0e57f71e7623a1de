"""`UploadSlots`: how many chunks a server uploads at once, and who goes next.

A server has `slots` concurrent uploads. A request that finds them all busy waits, and a freed
slot goes to the waiting request with the best priority: the puller that started pulling first,
then the one that already holds the most of the version. Every holder applies the same order, so
all of them concentrate on the same puller, which soon holds the whole version and becomes a
source itself; the sources double-up as pullers finish. Shared evenly instead, the sources would
bring every puller to completion (and to serving) only at the very end. The order is first come,
first served, so nobody starves. A request still waiting after `timeout` seconds is refused (the
server answers 503 and the puller asks again, or elsewhere).

Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

Priority = tuple[float, float]
"""Smaller first: (unix time the pull started, -bytes the puller already holds)."""


def priority(progress_bytes: int, pull_started: float) -> Priority:
    return (pull_started, -float(progress_bytes))


class UploadSlots:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._free = slots
        self._waiting: list[tuple[Priority, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def busy(self) -> int:
        return self.slots - self._free

    async def acquire(self, rank: Priority, timeout: float) -> bool:
        """Take a slot (True), or give up after `timeout` seconds (False). Release it after use."""
        if self._free and not self._waiting:
            self._free -= 1
            return True
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (rank, next(self._arrivals), granted))
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
        if granted.done():
            return True
        granted.cancel()
        return False

    def release(self) -> None:
        while self._waiting:
            _, _, granted = heapq.heappop(self._waiting)
            if not granted.done():
                granted.set_result(None)
                return
        self._free += 1
