"""One run directory, one driver (docs/internals.md §9).

A training session holds an exclusive `fcntl.flock` on `<run>/driver.lock` for its life; the file
says who holds it (`pid <pid> host <host>`). A second driver for the same run directory is refused
with `RunLocked`, naming the first's pid and host. `rlboost train` takes the lock before it starts
anything that writes shared state (the ephemeral Prefect server migrates its database) and hands
it to the session it opens in this process (`hold_for_session`, `session_lock`). The kernel drops
the lock when its holder's file is closed, which happens when the holder exits or is killed by any
signal, SIGKILL included: a crashed driver never blocks the re-run. (flock is per host on most
network file systems: two hosts sharing a run directory over NFS may not see each other's lock.)
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
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


_held: dict[Path, DriverLock] = {}
"""Locks taken for a session this process will open (`hold_for_session`), by resolved directory."""
_held_guard = threading.Lock()


def hold_for_session(directory: Path) -> DriverLock:
    """Take the lock of `directory` now (or raise `RunLocked`) and keep it for the first session
    of that run directory this process opens (`session_lock`)."""
    lock = DriverLock(directory)
    with _held_guard:
        _held[Path(directory).resolve()] = lock
    return lock


def release_unclaimed(directory: Path) -> None:
    """Free the lock `hold_for_session` took for `directory` if no session took it over (the run
    failed before its session opened)."""
    with _held_guard:
        held = _held.pop(Path(directory).resolve(), None)
    if held is not None:
        held.release()


def session_lock(directory: Path) -> DriverLock:
    """The lock of a session of `directory`: the one `hold_for_session` took for it, handed over
    once, else a new one (`RunLocked` when another driver, or session, holds it)."""
    with _held_guard:
        held = _held.pop(Path(directory).resolve(), None)
    return held if held is not None else DriverLock(directory)
