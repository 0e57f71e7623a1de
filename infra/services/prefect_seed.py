"""A migrated Prefect SQLite database per Prefect version, copied into place where a Prefect server
would otherwise migrate a new database itself (~110 alembic migrations, 7-8 s of CPU per start).

`seed_database(path, log)` copies the seed to `path` when no database is there yet, so the server
starts on a database at its head revision; it never replaces a file, and where anything fails (no
writable cache, a failed migration) it logs why and does nothing: the server migrates as before.
`ensure_seed()` keeps the seed in `seed_cache()` (`$RLBOOST_PREFECT_SEED_CACHE`, else
`$XDG_CACHE_HOME/rlboost/prefect-seeds` or `~/.cache/rlboost/prefect-seeds`), named by Prefect
version and head revision, made once by Prefect's own `prefect server database upgrade` in a
subprocess with a throwaway home; concurrent makers serialize on an flock in the cache. The seed
holds what the migrations write and nothing else. See docs/prefect.md ("Where Prefect keeps its state").
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import logging
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from infra.services.prefect_home import point_at_home
from rl.env_vars import PREFECT_SEED_CACHE as CACHE_ENV

Runner = Callable[..., subprocess.CompletedProcess]
"""Runs the migration command (`subprocess.run`'s signature); tests inject their own."""

LOCK_FILE = "prefect-seed.lock"
MIGRATION_TIMEOUT_S = 600.0
SIDE_FILES = ("-wal", "-shm", "-journal")
"""SQLite's files beside a database: one left without its database would be applied to the copy."""


class SeedUnavailable(RuntimeError):
    """No seed could be made; the message says why."""


def seed_cache(environ: Mapping[str, str] = os.environ) -> Path:
    """The directory of the seeds: `$RLBOOST_PREFECT_SEED_CACHE`, else the user's cache directory."""
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV]).expanduser().absolute()
    base = Path(environ["XDG_CACHE_HOME"]) if environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base.expanduser().absolute() / "rlboost" / "prefect-seeds"


def head_revision() -> str | None:
    """The head of the installed Prefect's SQLite migrations: the one revision no other follows
    (None: not found, or not one head)."""
    spec = importlib.util.find_spec("prefect")  # locates the package without importing it
    if not spec or not spec.origin:
        return None
    versions = Path(spec.origin).parent / "server" / "database" / "_migrations" / "versions" / "sqlite"
    revisions, followed = set(), set()
    for file in versions.glob("*.py"):
        text = file.read_text()
        revisions.update(re.findall(r"""^revision\s*=\s*["'](\w+)["']""", text, re.M))
        followed.update(re.findall(r"""^down_revision\s*=\s*["'](\w+)["']""", text, re.M))
    heads = revisions - followed
    return heads.pop() if len(heads) == 1 else None


def seed_name() -> str:
    """`prefect-<version>-<head revision>.db`; `SeedUnavailable` without a single head."""
    head = head_revision()
    if head is None:
        raise SeedUnavailable("the installed Prefect's migration head was not found")
    return f"prefect-{importlib.metadata.version('prefect')}-{head}.db"


def database_revisions(path: Path) -> list[str]:
    """The revisions in a SQLite database's `alembic_version` table (read only)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as connection:
        return [row[0] for row in connection.execute("SELECT version_num FROM alembic_version")]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (released when the file closes)."""
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        yield


def _migration_env(home: Path, database: Path) -> dict[str, str]:
    """This process's environment less its Prefect settings, with a throwaway home and `database`."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    point_at_home(env, home)
    env.update(
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{database}",
        DO_NOT_TRACK="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )
    return env


def _migrate(work: Path, name: str, run: Runner) -> Path:
    """A database at `work/prefect.db` that Prefect's own migration brought to `name`'s head,
    checked and checkpointed (no WAL beside it)."""
    database = work / "prefect.db"
    command = [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"]
    env = _migration_env(work / "home", database)
    done = run(command, env=env, cwd=work, capture_output=True, text=True, timeout=MIGRATION_TIMEOUT_S)
    if done.returncode != 0:
        output = " ".join(f"{done.stdout or ''} {done.stderr or ''}".split())[-300:]
        raise SeedUnavailable(f"`prefect server database upgrade` exited with {done.returncode}: {output}")
    head = name.rsplit("-", 1)[1].removesuffix(".db")
    with contextlib.closing(sqlite3.connect(database)) as connection:  # the last to close folds in its WAL
        revisions = [row[0] for row in connection.execute("SELECT version_num FROM alembic_version")]
    if revisions != [head] or any(Path(f"{database}{side}").exists() for side in SIDE_FILES):
        raise SeedUnavailable(f"the migrated database is at {revisions}, not at Prefect's head {head!r}")
    return database


def ensure_seed(cache: Path | None = None, run: Runner = subprocess.run) -> Path:
    """The seed of the installed Prefect in `cache` (default `seed_cache()`), made first if missing;
    `SeedUnavailable` (or `OSError`: the cache is not writable) when it cannot be had."""
    cache = cache or seed_cache()
    seed = cache / seed_name()
    if seed.is_file():
        return seed
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / LOCK_FILE):
        if seed.is_file():  # another maker made it while this one waited
            return seed
        with tempfile.TemporaryDirectory(dir=cache, prefix=".making-") as work:
            os.replace(_migrate(Path(work), seed.name, run), seed)
    return seed


def seed_database(database: Path, log: logging.Logger, cache: Path | None = None, run: Runner = subprocess.run) -> bool:
    """Copy the seed to the SQLite file `database` when nothing is there yet (True: copied). Never
    fails: a reason not to seed is logged (`log`), and the server then migrates the database itself."""
    if any(os.path.lexists(f"{database}{side}") for side in ("", *SIDE_FILES)):
        log.debug("Prefect seed database: not copied, %s or its SQLite files exist", database)
        return False
    try:
        seed = ensure_seed(cache, run)
    except OSError as error:  # no writable cache
        log.debug("Prefect seed database unavailable (the server migrates %s itself): %s", database, error)
        return False
    except (SeedUnavailable, sqlite3.Error, subprocess.SubprocessError) as error:
        log.warning("Prefect seed database unavailable (the server migrates %s itself): %s", database, error)
        return False
    try:
        database.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=database.parent, prefix=f".{database.name}.seed-") as work:
            copy = Path(work) / database.name
            shutil.copyfile(seed, copy)
            os.link(copy, database)  # appears whole, and never replaces a database made meanwhile
    except OSError as error:
        log.debug("Prefect seed database: not copied to %s: %s", database, error)
        return False
    log.debug("Prefect seed database: %s copied to %s", seed, database)
    return True
