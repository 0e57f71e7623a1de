"""Processes that end with the driver that started them (docs/internals.md §2, §9): rollout
workers, their engines' child processes and the DeepSpeed trainer ranks.

The driver (the training process, or whoever owns a `LocalProvider`) puts its pid in its children's
environment (`driver_environment()`, as `RLBOOST_DRIVER_PID`). A child calls `watch_driver(stop)`
once: a daemon thread polls that pid, and when the driver is gone (it exited, or was killed by any
signal, SIGKILL included) it calls `stop` (a graceful stop: hand work back) and, if the process is
still alive `grace_s` later (e.g. a drain blocked on a Redis that died with the driver), ends it
with `EXIT_DRIVER_GONE`.

A multiprocessing child of such a process that runs none of our code (vLLM's engine core) runs
`exit_with_multiprocessing_parent()`, registered as a vLLM general plugin in `pyproject.toml`: it
waits on the parent's sentinel (readable once the parent is gone, however it died) and exits.
A process that must not outlive its parent whatever it is doing (a trainer rank, its torchrun
agent's child) calls `die_with_parent()`: the kernel SIGKILLs it when the parent exits.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from rl import env_vars

log = logging.getLogger(__name__)

DRIVER_PID_ENV = env_vars.DRIVER_PID

EXIT_DRIVER_GONE = 3
"""Exit status of a process ended by its watchdog after its driver died."""


def driver_environment() -> dict[str, str]:
    """The environment entry that makes a child watch this process."""
    return {DRIVER_PID_ENV: str(os.getpid())}


def driver_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


def watch_driver(stop: Callable[[], None], *, grace_s: float = 5.0, poll_s: float = 0.5) -> threading.Thread | None:
    """Start the watchdog of the driver named in the environment; None when none is named."""
    value = os.environ.get(DRIVER_PID_ENV)
    if not value:
        return None
    pid = int(value)

    def watch() -> None:
        while driver_alive(pid):
            time.sleep(poll_s)
        log.warning("the driver (pid %d) is gone: stopping, exiting in at most %.0f s", pid, grace_s)
        stop()
        time.sleep(grace_s)
        log.warning("still running %.0f s after the driver died: exiting", grace_s)
        os._exit(EXIT_DRIVER_GONE)

    thread = threading.Thread(target=watch, name="driver-watch", daemon=True)
    thread.start()
    return thread


def exit_with_multiprocessing_parent() -> threading.Thread | None:
    """In a multiprocessing child, exit with `EXIT_DRIVER_GONE` when the parent dies; else None."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return None

    def watch() -> None:
        parent.join()  # returns once the parent's end of its sentinel pipe is closed: it is gone
        log.warning("the parent process (pid %s) is gone: exiting", parent.pid)
        os._exit(EXIT_DRIVER_GONE)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


PR_SET_PDEATHSIG = 1


def die_with_parent(is_expected_parent: Callable[[int], bool] = lambda pid: True) -> bool:
    """Have the kernel SIGKILL this process when its parent (the thread that started it) exits:
    `prctl(PR_SET_PDEATHSIG)`, which holds while the process blocks in a lock, a collective or C
    code, where a watchdog thread may never run. A parent already gone (this process adopted by
    init or a subreaper) or not `is_expected_parent(pid)` ends this process now with
    `EXIT_DRIVER_GONE`. False where there is no prctl (not Linux): nothing was set."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent or not is_expected_parent(parent):
        log.warning("the parent process (pid %d) is gone: exiting", parent)
        os._exit(EXIT_DRIVER_GONE)
    return True
