"""`UploadCap`: an emulated uplink, shared by everything one server sends.

On one machine every connection runs over loopback at memory speed, so no single source is
bandwidth-limited the way a cloud VM's NIC is. A server given a cap sends each piece of a response
when a link of that rate would have finished transmitting it: every `take(n)` reserves the next
n / rate seconds of the link and returns at the end of them, so all concurrent uploads of that
server together never exceed `bytes_per_s` (virtual scheduling). A sender that wakes up late (a busy
event loop) may make up for up to `LATE_WAKEUP_CREDIT_S` of lost link time; an idle link saves no
more credit than that. Used by the peer server (`WeightsConfig.upload_cap_mb_s`) and by the
benchmark's proxy in front of the object store. Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

import asyncio
import time

LATE_WAKEUP_CREDIT_S = 0.02


class UploadCap:
    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._link_free_at = 0.0

    async def take(self, nbytes: int) -> None:
        """Reserve the link for `nbytes` and wait until they would have been transmitted."""
        now = time.monotonic()
        self._link_free_at = max(now - LATE_WAKEUP_CREDIT_S, self._link_free_at) + nbytes / self.bytes_per_s
        if self._link_free_at > now:
            await asyncio.sleep(self._link_free_at - now)
