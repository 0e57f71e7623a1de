"""Detached service processes that outlive the command that started them, and stopping exactly them.

`start_detached` runs a command in a new session (its own process group, no controlling terminal),
its output appended to a log file, and returns a `ServiceProcess`: name, pid (= process group id),
the kernel's start time of that pid, the log path. The start time makes the record exact: `stop`
signals a group only while its leader is the process that was started (not a later process that
reused the pid), and sweeps members left behind by a leader that already exited by matching their
process group and start time. Linux only (/proc).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel


class ServiceProcess(BaseModel):
    """One process group the stack started."""

    name: str
    pid: int
    """Also the process group id (the process is its group's leader)."""
    start_ticks: int
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22)."""
    log: Path
    command: list[str]

    def leader_alive(self) -> bool:
        """The group leader is still the process that was started (and not a zombie)."""
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start_ticks and stat[2] != "Z"

    def members(self) -> list[int]:
        """Live processes of this group started with or after its leader (the leader included)."""
        return group_members(self.pid, since_ticks=self.start_ticks)


def group_members(pgid: int, since_ticks: int = 0) -> list[int]:
    """Live (not zombie) processes of process group `pgid` started at or after `since_ticks`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(int(entry))
        if stat is not None and stat[0] == pgid and stat[1] >= since_ticks and stat[2] != "Z":
            found.append(int(entry))
    return found


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(process group id, start ticks, state) of `pid`, or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[2]), int(fields[19]), fields[0]


def start_detached(
    name: str, command: Sequence[str], *, env: Mapping[str, str], log: Path, cwd: Path | None = None
) -> ServiceProcess:
    """Start `command` in its own session, stdout and stderr appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(command),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stat = _stat(proc.pid)
    if stat is None:  # exited at once: keep a record anyway; readiness checks will report it
        return ServiceProcess(name=name, pid=proc.pid, start_ticks=-1, log=log, command=list(command))
    return ServiceProcess(name=name, pid=proc.pid, start_ticks=stat[1], log=log, command=list(command))


def log_tail(path: Path, chars: int = 3000) -> str:
    """The end of a log file (or a note that there is none)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return f"(no log at {path})"


def stop(processes: Sequence[ServiceProcess], grace_s: float = 15.0) -> list[str]:
    """SIGTERM each group (in the given order), wait up to `grace_s` for all of them to exit, then
    SIGKILL what is left. Returns the names of the groups that were still running."""
    running = [p for p in processes if p.members()]
    for process in running:
        _signal(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.members() for p in running):
        time.sleep(0.1)
    for process in running:
        if process.members():
            _signal(process, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(p.members() for p in running):
        time.sleep(0.05)
    return [p.name for p in running]


def _signal(process: ServiceProcess, sig: signal.Signals) -> None:
    """Signal the whole group while its leader is ours; else only the members that are ours."""
    try:
        if process.leader_alive():
            os.killpg(process.pid, sig)
            return
        for pid in process.members():
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
