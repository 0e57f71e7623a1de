"""Run a command and turn a cloud's preemption notice into its SIGTERM drain.

`supervise(command, watcher)` starts `command` (the pool's Prefect worker) in its own session and
waits on a `Watcher` in a thread. When the notice comes, every process of the command's tree gets
SIGTERM at once (the Prefect worker, and the flow runs it started even in sessions of their own:
the rollout worker drains on SIGTERM); what still runs after `grace_s` gets SIGKILL. Then the
watcher acknowledges the notice (Azure lets the eviction proceed) and `supervise` returns the
command's exit status. A SIGTERM or SIGINT sent to the supervisor itself (a shutdown) is passed on
the same way. If the command exits by itself, so does the supervisor, with its status.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

POLL_S = 0.1
"""How often the supervisor checks the command and the notice."""


@dataclass(frozen=True)
class PreemptionNotice:
    """The cloud's word that this VM is being taken back."""

    source: str
    """`gce-metadata` or `azure-scheduled-events`."""
    event_id: str | None = None
    """The Scheduled Events `EventId` to acknowledge (Azure)."""
    not_before: str | None = None
    """When the cloud will stop the VM at the earliest, as the cloud wrote it (Azure)."""


class Watcher(Protocol):
    """Waits for this VM's preemption notice."""

    def wait_for_notice(self, stop: threading.Event) -> PreemptionNotice | None:
        """Block until the notice (returned) or until `stop` is set (None)."""

    def acknowledge(self, notice: PreemptionNotice) -> None:
        """Tell the cloud the VM is ready to go (called after the command has drained)."""


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant of it (from /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(parent, []).append(int(entry))
    tree, index = [root], 0
    while index < len(tree):
        tree.extend(children.get(tree[index], []))
        index += 1
    return tree


def signal_tree(root: int, sig: signal.Signals) -> None:
    """Send `sig` to `root` and all its descendants."""
    for pid in process_tree(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def supervise(command: Sequence[str], watcher: Watcher, *, grace_s: float = 25.0) -> int:
    """Run `command` until it exits or the notice (or our own SIGTERM/SIGINT) drains it."""
    child = subprocess.Popen(list(command), start_new_session=True)
    stop = threading.Event()
    notices: list[PreemptionNotice] = []
    asked_to_stop = threading.Event()

    def watch() -> None:
        try:
            notice = watcher.wait_for_notice(stop)
        except Exception:
            log.exception("the preemption watcher failed; the command keeps running without it")
            return
        if notice is not None:
            notices.append(notice)

    threading.Thread(target=watch, name="preemption-watcher", daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: asked_to_stop.set())
    try:
        while child.poll() is None and not notices and not asked_to_stop.is_set():
            time.sleep(POLL_S)
        if child.poll() is not None:
            return child.returncode
        if notices:
            log.warning("preemption notice (%s): draining %s", notices[0], command[0])
        else:
            log.warning("stopping: draining %s", command[0])
        signal_tree(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s did not drain within %.0f s: killing it", command[0], grace_s)
            signal_tree(child.pid, signal.SIGKILL)
            child.wait()
        if notices:
            watcher.acknowledge(notices[0])
        return child.returncode
    finally:
        stop.set()
