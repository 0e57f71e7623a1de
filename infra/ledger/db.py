"""Connecting to the ledger database and migrating its schema with Alembic.

- `create_ledger_engine(url)`: an engine for a SQLite or PostgreSQL URL. `postgresql://` and `postgres://`
  mean the psycopg 3 driver (`postgresql+psycopg://`). A SQLite file's folder is created (or, with
  `must_exist=True`, a missing file is refused); SQLite enforces foreign keys; `sqlite://` is an
  in-memory database shared by the engine's connections. The connection is tried at once.
- `upgrade_to_head(engine)` / `downgrade_to(engine, revision)` / `current_revision(engine)`:
  Alembic configured in code; its scripts live in `infra/ledger/migrations` (no alembic.ini).
- `LedgerUnavailable`: any failure to reach or use the database. Its message names the URL with
  the password masked, the reason, and how to fix it. `translate_errors()` converts driver errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, InterfaceError, NoSuchModuleError, OperationalError
from sqlalchemy.pool import StaticPool

from rl import env_vars

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
SUPPORTED_BACKENDS = ("sqlite", "postgresql")
CONNECT_TIMEOUT_S = 10
"""Seconds to wait for a database server before declaring it unreachable."""
URL_FIX = (
    f"set the ledger URL (`ledger.url` in the run configuration, `--db` for `rlboost cost`, or ${env_vars.LEDGER_URL})"
)


class LedgerUnavailable(RuntimeError):
    """The ledger database cannot be reached or used; the message names the URL (no password) and the fix."""


def normalize_url(url: str) -> URL:
    """Parse `url`; plain `postgresql://` / `postgres://` select the psycopg 3 driver."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            url = "postgresql+psycopg://" + url[len(plain) :]
    try:
        return make_url(url)
    except ArgumentError:
        raise LedgerUnavailable(
            f"{url!r} is not a database URL: expected e.g. sqlite:///.rlboost/ledger.sqlite or "
            f"postgresql+psycopg://USER@HOST:5432/DB. Fix: {URL_FIX}"
        ) from None


def safe_url(url: URL | str) -> str:
    """The URL as text with its password masked."""
    parsed = url if isinstance(url, URL) else normalize_url(url)
    return parsed.render_as_string(hide_password=True)


def _is_memory(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def _enable_foreign_keys(dbapi_connection, _record) -> None:
    dbapi_connection.execute("PRAGMA foreign_keys=ON")


def create_ledger_engine(url: str, *, must_exist: bool = False) -> Engine:
    """An engine on `url` whose connection works; `LedgerUnavailable` otherwise (see module docstring)."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() not in SUPPORTED_BACKENDS:
        raise LedgerUnavailable(f"{safe_url(parsed)}: the ledger supports SQLite and PostgreSQL only. Fix: {URL_FIX}.")
    sqlite = parsed.get_backend_name() == "sqlite"
    options: dict = {}
    if sqlite and _is_memory(parsed):
        options = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
    elif sqlite:
        path = Path(parsed.database)
        if must_exist and not path.is_file():
            raise LedgerUnavailable(
                f"no ledger database at {path.resolve()} ({safe_url(parsed)}): nothing was recorded there. "
                f"Fix: {URL_FIX} to the ledger the training run wrote."
            )
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        options = {"pool_pre_ping": True}
        if parsed.get_driver_name() == "psycopg":
            options["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    try:
        engine = create_engine(parsed, **options)
    except (NoSuchModuleError, ImportError) as error:
        raise LedgerUnavailable(
            f"cannot open the ledger database {safe_url(parsed)}: no driver ({error}). "
            f"Fix: use sqlite:///PATH, or postgresql+psycopg://... with `pip install 'psycopg[binary]'`."
        ) from None
    if sqlite:
        event.listen(engine, "connect", _enable_foreign_keys)
    try:
        with translate_errors(engine):
            engine.connect().close()
    except LedgerUnavailable:
        engine.dispose()
        raise
    return engine


@contextmanager
def translate_errors(engine: Engine) -> Iterator[None]:
    """Turn a driver's connection or operational error into `LedgerUnavailable`."""
    try:
        yield
    except (OperationalError, InterfaceError) as error:
        reason = (str(error.orig).strip().splitlines() or [type(error.orig).__name__])[0]
        raise LedgerUnavailable(
            f"cannot use the ledger database {safe_url(engine.url)}: {reason}. Fix: check that the database "
            f"is running and reachable and that the URL is right, or {URL_FIX}."
        ) from error


def alembic_config(connection) -> Config:
    """Alembic's configuration, in code: this package's scripts, migrating `connection`."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("path_separator", "os")
    config.attributes["connection"] = connection
    return config


def upgrade_to_head(engine: Engine) -> None:
    """Apply every migration the database lacks (a no-op when it is current)."""
    with translate_errors(engine), engine.begin() as connection:
        command.upgrade(alembic_config(connection), "head")


def downgrade_to(engine: Engine, revision: str) -> None:
    """Revert migrations down to `revision` (`base`: drop the whole schema)."""
    with translate_errors(engine), engine.begin() as connection:
        command.downgrade(alembic_config(connection), revision)


def current_revision(engine: Engine) -> str | None:
    """The schema revision of the database (None: no ledger schema yet)."""
    with translate_errors(engine), engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
