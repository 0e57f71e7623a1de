"""`<run>/redis.url`: where a running run's own (embedded) Redis answers, for the user's other
commands (`rlboost status --run NAME`).

The URL holds that Redis's random password: the file is written owner-only (0600) and atomically
when the fabric starts its embedded Redis, and removed when the fabric stops it. A driver killed
outright leaves the file behind, naming a Redis gone with it (a command reading it then says it
cannot reach that Redis). A run on a Redis of the user's own (`fabric.redis_url`,
`$RLBOOST_REDIS_URL`) writes none: the user has its URL.
"""

from __future__ import annotations

import os
from pathlib import Path

REDIS_URL_FILE = "redis.url"


def write_redis_url(run_dir: Path, url: str) -> None:
    """Write `url` to `<run_dir>/redis.url`, readable by its owner only."""
    path = Path(run_dir) / REDIS_URL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{REDIS_URL_FILE}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(url + "\n")
    os.replace(temporary, path)


def remove_redis_url(run_dir: Path) -> None:
    Path(run_dir, REDIS_URL_FILE).unlink(missing_ok=True)


def read_redis_url(run_dir: Path) -> str | None:
    """The URL a running run's embedded Redis answers at; None if the run has no such file."""
    try:
        return Path(run_dir, REDIS_URL_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None
