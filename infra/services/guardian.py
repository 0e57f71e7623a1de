"""The guardian: a small process that ends, when the driver dies by any signal (SIGKILL included),
the processes the driver started through code it does not own, which therefore cannot be made to
watch the driver themselves: Prefect's ephemeral API server (a uvicorn process Prefect spawns).

`Guardian.start()` spawns `python -m infra.services.guardian` in a session of its own (a Ctrl-C
to the driver's terminal does not reach it), with a pipe as its stdin; `watch(pid)` writes the
pid and the process's start time on it. When the driver dies the kernel closes its end of the
pipe: the guardian reads end-of-file, sends SIGTERM to every watched process that is still the
same process (same start time: no pid reuse), SIGKILL to those left after `GRACE_S`, and exits.
A driver that exits normally closes the pipe too, after its own clean-up (Prefect stops its
server at exit), so the guardian then finds nothing left to end.

Processes of our own (rollout workers, trainer ranks, embedded Redis) watch the driver directly
(`rl.driver_watch`, a parent-death signal); the guardian is for the rest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 5.0
"""Seconds between the SIGTERM and the SIGKILL of a watched process that is still running."""


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc), None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


class Guardian:
    """The driver's side: one guardian process, started once, that outlives nothing it watches."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "infra.services.guardian"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self._process.pid

    def watch(self, pid: int) -> None:
        """End `pid` when this process dies (or exits)."""
        started = start_time(pid)
        if started is None:
            return
        assert self._process.stdin is not None
        self._process.stdin.write(f"{pid} {started}\n")
        self._process.stdin.flush()


_guardian: Guardian | None = None


def guardian() -> Guardian:
    """This process's guardian, started on first use; kept for the life of the process (its pipe
    closing is the signal)."""
    global _guardian
    if _guardian is None:
        _guardian = Guardian()
    return _guardian


def _end(watched: dict[int, int]) -> None:
    """SIGTERM, then after `GRACE_S` SIGKILL, each watched process that is still the one watched."""

    def same(pid: int) -> bool:
        return start_time(pid) == watched[pid]

    def send(sig: signal.Signals) -> None:
        for pid in [p for p in watched if same(p)]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # it ended in between

    send(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(same(p) for p in watched):
        time.sleep(0.1)
    send(signal.SIGKILL)


def main() -> None:
    """The guardian process: read `pid start_time` lines until end-of-file, then end them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watched: dict[int, int] = {}
    for line in sys.stdin:
        pid, started = line.split()
        watched[int(pid)] = int(started)
    _end(watched)


if __name__ == "__main__":
    main()
