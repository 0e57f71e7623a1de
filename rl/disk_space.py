"""Naming a full disk: whether an error came from a file system out of space, and how much room a
path's file system has left, in words, for the messages that say so (`rl.checkpoint`, the local
instances' start failures); `no_room_to_start(directory)`: the line refusing a run whose directory
lies on a full file system, before the run writes anything (`rlboost train`)."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

LOW_SPACE_BYTES = 16 << 20
"""Below this much free space a file system counts as full for a failure that names no cause
(torch reports a short write as "unexpected pos" and nothing more)."""

ROOM_TO_START_BYTES = 64 << 10
"""Below this much free space the run directory's file system is full before the run starts: its
lock, its logs and the Prefect server's log alone take more."""

_OUT_OF_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_OUT_OF_SPACE_TEXT = ("no space left on device", "os error 28", "disk quota exceeded")


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and the errors it was raised from or during, each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def out_of_space(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from or during, is a file system out of space."""
    return any(
        (isinstance(e, OSError) and e.errno in _OUT_OF_SPACE_ERRNOS)
        or any(text in str(e).lower() for text in _OUT_OF_SPACE_TEXT)
        for e in _chain(error)
    )


def full_path(error: BaseException) -> str | None:
    """The file whose write ran out of space, when an `OSError` in the chain names one."""
    return next((str(e.filename) for e in _chain(error) if isinstance(e, OSError) and e.filename), None)


def _free_and_total(path: Path) -> tuple[int, int] | None:
    """Free and total bytes of the file system holding `path` (or its nearest existing parent);
    None if unknown."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                usage = shutil.disk_usage(candidate)
            except OSError:
                return None
            return usage.free, usage.total
    return None


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system holding `path`; None if unknown."""
    usage = _free_and_total(Path(path))
    return None if usage is None else usage[0]


def no_room_to_start(directory: Path) -> str | None:
    """The one line that refuses a run whose directory's file system has less than
    `ROOM_TO_START_BYTES` free; None when it has more (or its free space is unknown)."""
    free = free_bytes(directory)
    if free is None or free >= ROOM_TO_START_BYTES:
        return None
    return (
        f"run.output_dir: no space left on the device for the run directory {directory}: {describe_free(directory)}. "
        "Free some space, or set run.output_dir on a larger disk"
    )


def describe_free(path: str | Path) -> str:
    """E.g. "2.1 MB free of 1.0 GB on the file system of /runs/x"."""
    usage = _free_and_total(Path(path))
    if usage is None:
        return f"free space on the file system of {path} unknown"
    free, total = usage
    return f"{_size(free)} free of {_size(total)} on the file system of {path}"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
