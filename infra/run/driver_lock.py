"""One run directory, one driver (docs/internals.md §9).

A training session holds an exclusive `fcntl.flock` on `<run>/driver.lock` for its life; the file
says who holds it (`pid <pid> host <host>`). A second driver for the same run directory is refused
with `RunLocked`, naming the first's pid and host. The kernel drops the lock when its holder's file
is closed, which happens when the holder exits or is killed by any signal, SIGKILL included: a
crashed driver never blocks the re-run. (flock is per host on most network file systems: two
hosts sharing a run directory over NFS may not see each other's lock.)
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = "driver.lock"


class RunLocked(RuntimeError):
    """Another live driver holds the run directory; the message names its pid and host."""


class DriverLock:
    """The held lock of one run directory; `release()` (or this object's collection) frees it."""

    def __init__(self, directory: Path) -> None:
        """Take the lock now, or raise `RunLocked`."""
        self.path = Path(directory) / LOCK_FILE
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a process that has not written its pid yet"
            handle.close()
            raise RunLocked(
                f"run directory {Path(directory)} is in use by another driver ({holder}): wait for that "
                "run to end or stop it, or give this one another run.name"
            ) from None
        handle.truncate(0)
        handle.write(f"pid {os.getpid()} host {socket.gethostname()}\n")
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        """Free the lock (idempotent); the file stays, naming the last holder."""
        self._handle.close()
