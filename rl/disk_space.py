"""Naming a full disk: whether an error came from a file system out of space, and how much room a
path's file system has left, in words, for the messages that say so (`rl.checkpoint`, the local
instances' start failures)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

LOW_SPACE_BYTES = 16 << 20
"""Below this much free space a file system counts as full for a failure that names no cause
(torch reports a short write as "unexpected pos" and nothing more)."""

_OUT_OF_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_OUT_OF_SPACE_TEXT = ("no space left on device", "os error 28", "disk quota exceeded")


def out_of_space(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from or during, is a file system out of space."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _OUT_OF_SPACE_ERRNOS:
            return True
        if any(text in str(current).lower() for text in _OUT_OF_SPACE_TEXT):
            return True
        current = current.__cause__ or current.__context__
    return False


def full_path(error: BaseException) -> str | None:
    """The file whose write ran out of space, when an `OSError` in the chain names one."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.filename:
            return str(current.filename)
        current = current.__cause__ or current.__context__
    return None


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system holding `path` (or its nearest existing parent); None if unknown."""
    path = Path(path)
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def describe_free(path: str | Path) -> str:
    """E.g. "2.1 MB free of 1.0 GB on the file system of /runs/x"."""
    path = Path(path)
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                usage = shutil.disk_usage(candidate)
            except OSError as exc:
                return f"free space on the file system of {path} unknown ({exc})"
            return f"{_size(usage.free)} free of {_size(usage.total)} on the file system of {path}"
    return f"free space on the file system of {path} unknown"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
