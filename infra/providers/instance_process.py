"""The process of a local instance, as its `LocalProvider` sees it: a process group led by `pid`,
whose exit is seen without reaping it (so the pid and group are not reused while the provider still
signals the group), then reaped for its exit code.

`FreshProcess` is a new interpreter the provider started itself (`subprocess.Popen`);
`rl.warm_fork.client.ForkedProcess` is one forked from a fork template.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Protocol


class InstanceProcess(Protocol):
    pid: int
    """The process, and its process group."""

    def exited(self) -> bool:
        """Whether it has exited (not reaped: its pid and group stay reserved)."""
        ...

    def wait_exited(self) -> None:
        """Block until it has exited, without reaping it."""
        ...

    def reap(self) -> int | None:
        """Reap it (after it exited): its exit code, negative for the signal that ended it; None
        when no one can say any more (its fork template is gone)."""
        ...


class FreshProcess:
    """An instance started as a new interpreter, a child of this process."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    def exited(self) -> bool:
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def wait_exited(self) -> None:
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)

    def reap(self) -> int:
        return self.popen.wait()


def signal_group(process: InstanceProcess, sig: signal.Signals) -> None:
    """Send `sig` to the instance's process group (nothing when it is gone)."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
