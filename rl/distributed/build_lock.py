"""Torch's JIT extension build locks: finding one its owner left behind, and clearing it.

A DeepSpeed rank on CPU JIT-compiles DeepSpeed's communication op (`deepspeed_shm_comm`) through
`torch.utils.cpp_extension.load`, which builds under a lock file, `<build dir>/lock`
(`torch.utils.file_baton.FileBaton`): created with O_EXCL, its descriptor held open by the builder
for the build, deleted after it. Every other process loading the op waits while the file exists,
with no deadline, so a build stopped midway (Ctrl-C, SIGKILL) makes every later load wait forever.
`build_locks(root)` lists the lock files under an extensions root (`$TORCH_EXTENSIONS_DIR`, else
torch's `~/.cache/torch_extensions`) with the processes that hold each open (`/proc/<pid>/fd`);
`clear_stale(root)` deletes the ones no live process holds (seen so twice, `CONFIRM_S` apart: a
builder releasing its lock closes it, then deletes it). A lock of another user is not judged (its
processes cannot be read): `describe` names its file to delete. Linux only; a build on another
host sharing the directory is not seen.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

CONFIRM_S = 1.0
"""Between the two looks that must both find a lock unheld before it is deleted."""


@dataclass(frozen=True)
class BuildLock:
    """A build lock file and who holds it."""

    path: Path
    holders: tuple[int, ...]
    """Pids of the live processes that have the file open (the builder)."""
    judged: bool
    """Whether every process that could hold it was looked at (False: another user's file)."""
    identity: tuple[int, int, int]
    """(device, inode, creation time) of the file: a lock deleted and taken again is another lock."""

    @property
    def stale(self) -> bool:
        return self.judged and not self.holders


def extensions_root(environ: Mapping[str, str] = os.environ) -> Path:
    """Where torch builds JIT extensions for a process with environment `environ`."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def _lock_files(root: Path) -> list[Path]:
    """`<root>/<name>/lock` ($TORCH_EXTENSIONS_DIR) and `<root>/<py>_<accelerator>/<name>/lock`."""
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def _open_files() -> dict[tuple[int, int], set[int]]:
    """(device, inode) -> pids having that file open, over every process this user may read."""
    opened: dict[tuple[int, int], set[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            descriptors = os.listdir(f"/proc/{entry.name}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in descriptors:
            try:
                info = os.stat(f"/proc/{entry.name}/fd/{fd}")
            except OSError:
                continue
            opened.setdefault((info.st_dev, info.st_ino), set()).add(int(entry.name))
    return opened


def build_locks(root: Path) -> list[BuildLock]:
    """The build locks under `root` now, with their holders."""
    files = _lock_files(root)
    if not files:
        return []
    opened = _open_files()
    locks = []
    for path in files:
        try:
            info = path.stat()
        except FileNotFoundError:  # released meanwhile
            continue
        holders = tuple(sorted(opened.get((info.st_dev, info.st_ino), ())))
        judged = os.geteuid() in (0, info.st_uid)
        locks.append(BuildLock(path, holders, judged, (info.st_dev, info.st_ino, info.st_ctime_ns)))
    return locks


def clear_stale(root: Path, confirm_s: float = CONFIRM_S, sleep: Callable[[float], None] = time.sleep) -> list[Path]:
    """Delete the locks under `root` that no live process holds, seen so twice `confirm_s` apart
    (the same file both times); returns the files deleted."""
    first = [lock for lock in build_locks(root) if lock.stale]
    if not first:
        return []
    sleep(confirm_s)
    again = {lock.path: lock for lock in build_locks(root) if lock.stale}
    removed = []
    for lock in first:
        seen = again.get(lock.path)
        if seen is not None and seen.identity == lock.identity:
            try:
                lock.path.unlink()
            except FileNotFoundError:
                continue
            removed.append(lock.path)
    return removed


def describe(locks: list[BuildLock]) -> str:
    """What the locks mean to a process waiting on them, with the file to delete where it may be
    stale ('' for no lock)."""
    parts = []
    for lock in locks:
        if lock.holders:
            pids = ", ".join(map(str, lock.holders))
            parts.append(f"the extension build lock {lock.path} is held by pid {pids} (a build in progress)")
        else:
            parts.append(
                f"the extension build lock {lock.path} is another user's: if no build of theirs runs, delete it"
                if not lock.judged
                else f"the extension build lock {lock.path} is held by no process: delete it"
            )
    return "; ".join(parts)
