"""The project's own Prefect home: `.rlboost/prefect` (from the working directory, beside the base
model), or `$RLBOOST_PREFECT_HOME`, so that the ephemeral server of `rlboost demo`/`train` keeps its
SQLite database there and never reads, breaks on or migrates a `~/.prefect` another Prefect owns.

`use_project_home()` decides it, once, for the `rlboost` command (`infra.cli.app` calls it before
anything imports Prefect, which reads its settings at import): it sets `PREFECT_HOME` unless the
user runs Prefect their own way (`own_prefect`: their PREFECT_HOME, profile, server or database);
`$RLBOOST_PREFECT_HOME` wins over those. `point_at_home()` gives a process environment a home (the
stack's processes get `<state dir>/prefect-home`). `database_problem(url)` tells, without starting
anything, why Prefect's server could not start on a SQLite database: a migration revision another
Prefect version wrote (the server would fail with alembic's "Can't locate revision" at each
attempt), or a file that is not a database. See docs/prefect.md ("Where Prefect keeps its state").
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sqlite3
import sys
import tomllib
from collections.abc import MutableMapping
from pathlib import Path
from urllib.parse import urlsplit

from rl.env_vars import PREFECT_HOME as HOME_ENV

DEFAULT_HOME = Path(".rlboost") / "prefect"
OWN_PREFECT_SETTINGS = (
    "PREFECT_API_URL",
    "PREFECT_API_DATABASE_CONNECTION_URL",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL",
)
"""Settings that mean the user points Prefect at a server or database of their own."""


def project_home(environ: MutableMapping[str, str] = os.environ) -> Path:
    """`$RLBOOST_PREFECT_HOME`, else `.rlboost/prefect`; absolute (processes started later may run
    elsewhere)."""
    return Path(environ.get(HOME_ENV) or DEFAULT_HOME).expanduser().absolute()


HOME_PATHS = {
    "PREFECT_SERVER_MEMO_STORE_PATH": "memo_store.toml",
    "PREFECT_RESULTS_LOCAL_STORAGE_PATH": "storage",
    "PREFECT_LOGGING_CONFIG_PATH": "logging.yml",
}
"""Files Prefect 3.7 keeps in `~/.prefect` whatever `PREFECT_HOME` says (their defaults do not see
it), so they are set with it."""


def point_at_home(env: MutableMapping[str, str], home: Path) -> None:
    """Make the Prefect of a process with environment `env` use `home` (read when Prefect is
    imported): `PREFECT_HOME` (created: Prefect makes only its last level) and `HOME_PATHS` in it,
    and no profile of another home."""
    home.mkdir(parents=True, exist_ok=True)
    env["PREFECT_HOME"] = str(home)
    env.update({name: str(home / leaf) for name, leaf in HOME_PATHS.items()})
    env.pop("PREFECT_PROFILE", None)
    env.pop("PREFECT_PROFILES_PATH", None)


def _active_profile_settings(environ: MutableMapping[str, str]) -> dict:
    """The settings of the active profile of `~/.prefect/profiles.toml` merged over Prefect's
    bundled defaults (as Prefect merges them); {} when unreadable."""
    spec = importlib.util.find_spec("prefect")  # locates the package without importing it
    files = [Path(spec.origin).parent / "settings" / "profiles.toml"] if spec and spec.origin else []
    files.append(Path(environ.get("HOME") or Path.home()) / ".prefect" / "profiles.toml")
    active, profiles = None, {}
    for file in files:
        try:
            content = tomllib.loads(file.read_text())
        except (OSError, ValueError):
            continue
        active = content.get("active", active)
        for name, settings in content.get("profiles", {}).items():
            profiles.setdefault(name, {}).update(settings or {})
    return profiles.get(active, {}) if active else {}


def own_prefect(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """What says that the user runs Prefect their own way (None: nothing does)."""
    for name in ("PREFECT_HOME", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH", *OWN_PREFECT_SETTINGS):
        if environ.get(name):
            return f"${name}"
    profile = _active_profile_settings(environ)
    for name in OWN_PREFECT_SETTINGS:
        if profile.get(name):
            return f"{name} in the active profile of ~/.prefect/profiles.toml"
    return None


def use_project_home(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Point this process's Prefect at the project's home (see the module docstring); returns it,
    or None where the user's own Prefect configuration stays (or Prefect is already imported, its
    settings read: too late to change them)."""
    if "prefect" in sys.modules:
        return None
    if not environ.get(HOME_ENV) and own_prefect(environ):
        return None
    home = project_home(environ)
    point_at_home(environ, home)
    return home


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite database URL (None: another database, or SQLite in memory)."""
    parts = urlsplit(url)
    if not parts.scheme.startswith("sqlite") or ":memory:" in url:
        return None
    path = parts.path[1:] if parts.path.startswith("/") else parts.path  # sqlite:///<path>
    return Path(path) if path else None


def known_revisions() -> set[str] | None:
    """The migration revisions of the installed Prefect's SQLite schema (None: not found)."""
    spec = importlib.util.find_spec("prefect")
    if not spec or not spec.origin:
        return None
    versions = Path(spec.origin).parent / "server" / "database" / "_migrations" / "versions" / "sqlite"
    pattern = re.compile(r"""^revision\s*=\s*["'](\w+)["']""", re.M)
    revisions = {m.group(1) for file in versions.glob("*.py") for m in pattern.finditer(file.read_text())}
    return revisions or None


def database_problem(url: str, prefect_version: str, elsewhere: str) -> str | None:
    """Why Prefect `prefect_version` could not start its server on the SQLite database at `url`,
    with the fix (move it aside, or `elsewhere`: how to use another database), in one sentence
    (None: nothing wrong found, or not a SQLite file that exists)."""
    path = sqlite_path(url)
    if path is None or not path.is_file():
        return None
    fix = f"move it aside (e.g. `mv {path} {path}.old`) or {elsewhere}"
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as connection:
            tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "alembic_version" not in tables:  # empty, or not Prefect's: Prefect says what it finds
                return None
            rows = connection.execute("SELECT version_num FROM alembic_version").fetchall()
    except sqlite3.DatabaseError as error:
        return f"the Prefect database {path} cannot be read ({error}); {fix}"
    known = known_revisions()
    unknown = sorted(row[0] for row in rows if known is not None and row[0] not in known)
    if not unknown:
        return None
    return (
        f"the Prefect database {path} carries migration revision {', '.join(map(repr, unknown))}, which the "
        f"installed Prefect {prefect_version} does not know: another (likely newer) Prefect version migrated it; "
        f"{fix}, or run the Prefect version that migrated it"
    )
