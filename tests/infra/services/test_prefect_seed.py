"""The migrated seed database of new Prefect homes (`infra.services.prefect_seed`): made once per
Prefect version and reused, one maker at a time, copied only where no database is, and nothing at
all (the server migrates as before) where it cannot be had. The unit tests migrate with a stand-in
for Prefect's command; the integration tests run Prefect's own migration and a real server."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from infra.services.prefect_home import database_problem, known_revisions
from infra.services.prefect_seed import (
    LOCK_FILE,
    database_revisions,
    ensure_seed,
    head_revision,
    seed_cache,
    seed_database,
    seed_name,
)
from rl.env_vars import PREFECT_SEED_CACHE
from tests.helpers import REPO_ROOT

log = logging.getLogger("test_prefect_seed")


class FakeMigration:
    """Stands in for `prefect server database upgrade`: writes a database at `revision` where the
    command's environment points, after `delay_s`; `fail` exits 1 having written half of one."""

    def __init__(self, revision: str | None = None, delay_s: float = 0.0, fail: bool = False) -> None:
        self.revision = revision or head_revision()
        self.delay_s, self.fail = delay_s, fail
        self.calls = 0
        self.commands: list[list[str]] = []

    def __call__(self, command, *, env, cwd, **_) -> subprocess.CompletedProcess:
        self.calls += 1
        self.commands.append(command)
        assert not env.get("PREFECT_HOME", "").startswith(str(Path.home() / ".prefect")), env["PREFECT_HOME"]
        path = Path(env["PREFECT_API_DATABASE_CONNECTION_URL"].removeprefix("sqlite+aiosqlite:///"))
        assert path.parent == Path(cwd)
        time.sleep(self.delay_s)
        if self.fail:
            path.write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)
            return subprocess.CompletedProcess(command, 1, "", "sqlite3.OperationalError: disk I/O error")
        with sqlite3.connect(path) as connection:
            connection.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)")
            connection.execute("INSERT INTO alembic_version VALUES (?)", (self.revision,))
            connection.execute("CREATE TABLE flow (id CHAR(36) NOT NULL PRIMARY KEY)")
        connection.close()
        return subprocess.CompletedProcess(command, 0, "Migrations succeeded!", "")


def _at_head(path: Path) -> None:
    """`path` is a whole SQLite database at the installed Prefect's head that a server would accept."""
    assert database_revisions(path) == [head_revision()]
    assert database_problem(f"sqlite+aiosqlite:///{path}", "test", "-") is None


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name != LOCK_FILE) if cache.exists() else []


def test_the_seed_is_named_by_prefect_version_and_head_revision():
    import prefect

    head = head_revision()
    assert head is not None and head in (known_revisions() or set())
    assert seed_name() == f"prefect-{prefect.__version__}-{head}.db"


def test_the_cache_directory(tmp_path):
    assert seed_cache({PREFECT_SEED_CACHE: str(tmp_path / "s")}) == tmp_path / "s"
    assert seed_cache({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "rlboost" / "prefect-seeds"
    assert seed_cache({}) == Path.home().absolute() / ".cache" / "rlboost" / "prefect-seeds"
    assert Path(os.environ[PREFECT_SEED_CACHE]).name == "prefect-seeds"  # tests keep theirs out of ~/.cache
    assert not Path(os.environ[PREFECT_SEED_CACHE]).is_relative_to(Path.home() / ".cache")


def test_a_seed_is_made_once_and_reused(tmp_path):
    cache, migration = tmp_path / "cache", FakeMigration()
    assert seed_database(tmp_path / "a" / "prefect.db", log, cache, migration)
    seed = cache / seed_name()
    made = seed.stat().st_mtime_ns
    assert seed_database(tmp_path / "b" / "prefect.db", log, cache, migration)
    assert migration.calls == 1 and seed.stat().st_mtime_ns == made
    assert migration.commands[0][1:] == ["-m", "prefect", "server", "database", "upgrade", "-y"]
    for home in "ab":
        copy = tmp_path / home / "prefect.db"
        assert copy.read_bytes() == seed.read_bytes()
        _at_head(copy)
        assert sorted(p.name for p in copy.parent.iterdir()) == ["prefect.db"]  # no temporary copy left
    assert _leftovers(cache) == [seed.name]


def test_concurrent_makers_make_one_seed_and_whole_copies(tmp_path):
    cache, migration = tmp_path / "cache", FakeMigration(delay_s=0.5)
    databases = [tmp_path / f"home-{i}" / "prefect.db" for i in range(4)]
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda d=d: results.append(seed_database(d, log, cache, migration))) for d in databases
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [True] * 4 and migration.calls == 1
    for database in databases:
        _at_head(database)
    assert _leftovers(cache) == [seed_name()]


def test_an_existing_database_is_never_overwritten(tmp_path):
    cache, migration = tmp_path / "cache", FakeMigration()
    existing = tmp_path / "prefect.db"
    existing.write_bytes(b"the user's database")
    assert not seed_database(existing, log, cache, migration)
    assert existing.read_bytes() == b"the user's database"
    directory = tmp_path / "dir" / "prefect.db"  # what the server cannot open stays for it to say so
    directory.mkdir(parents=True)
    assert not seed_database(directory, log, cache, migration) and directory.is_dir()
    orphan = tmp_path / "orphan" / "prefect.db"  # a WAL without its database would be applied to a copy
    orphan.parent.mkdir()
    Path(f"{orphan}-wal").write_bytes(b"wal")
    assert not seed_database(orphan, log, cache, migration) and not orphan.exists()
    assert migration.calls == 0


def test_a_database_made_while_copying_is_kept(tmp_path, monkeypatch):
    """The copy appears by a link that fails where a file appeared meanwhile, never by a replace."""
    cache, migration = tmp_path / "cache", FakeMigration()
    database = tmp_path / "home" / "prefect.db"
    real_link = os.link

    def link_after_a_rival(source, target):
        Path(target).write_bytes(b"the rival's database")
        real_link(source, target)

    monkeypatch.setattr("infra.services.prefect_seed.os.link", link_after_a_rival)
    assert not seed_database(database, log, cache, migration)
    assert database.read_bytes() == b"the rival's database"
    assert sorted(p.name for p in database.parent.iterdir()) == ["prefect.db"]


@pytest.mark.parametrize("migration", [FakeMigration(fail=True), FakeMigration(revision="0123456789ab")])
def test_a_failed_migration_leaves_no_seed_and_the_caller_proceeds(tmp_path, caplog, migration):
    cache, database = tmp_path / "cache", tmp_path / "home" / "prefect.db"
    with caplog.at_level(logging.DEBUG, logger=log.name):
        assert not seed_database(database, log, cache, migration)
    assert migration.calls == 1
    assert _leftovers(cache) == [] and not database.exists()
    assert not database.parent.exists() or list(database.parent.iterdir()) == []
    [record] = caplog.records
    assert record.levelno == logging.WARNING and f"the server migrates {database} itself" in record.getMessage()
    assert ("exited with 1: " if migration.fail else "not at Prefect's head") in record.getMessage()


def test_a_timed_out_migration_leaves_no_seed(tmp_path):
    def hangs(command, **_):
        raise subprocess.TimeoutExpired(command, 600)

    assert not seed_database(tmp_path / "home" / "prefect.db", log, tmp_path / "cache", hangs)
    assert _leftovers(tmp_path / "cache") == []


def test_an_unwritable_cache_does_nothing(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    migration, database = FakeMigration(), tmp_path / "home" / "prefect.db"
    with caplog.at_level(logging.DEBUG, logger=log.name):
        assert not seed_database(database, log, blocker / "cache", migration)
    assert migration.calls == 0 and not database.exists() and blocker.read_text() == ""
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


@pytest.mark.integration
def test_prefects_own_migration_makes_one_seed_of_nothing_but_its_schema(tmp_path):
    """Two makers at once run Prefect's migration once; the seed holds the schema at head, no row
    but alembic's, and no WAL beside it."""
    cache, runs = tmp_path / "cache", []

    def counted(command, **kwargs):
        runs.append(command)
        return subprocess.run(command, **kwargs)

    databases = [tmp_path / f"home-{i}" / "prefect.db" for i in range(2)]
    threads = [threading.Thread(target=seed_database, args=(d, log, cache, counted)) for d in databases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(runs) == 1
    seed = cache / seed_name()
    assert _leftovers(cache) == [seed.name]
    for database in databases:
        assert database.read_bytes() == seed.read_bytes()
    _at_head(databases[0])
    with sqlite3.connect(databases[0]) as connection:
        tables = [row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        rows = {t: connection.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
        assert connection.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    connection.close()
    assert len(tables) > 30 and {"flow", "flow_run", "work_pool"} <= set(tables)
    assert {t: n for t, n in rows.items() if n} == {"alembic_version": 1}
    assert ensure_seed(cache, counted) == seed and len(runs) == 1


@pytest.mark.integration
def test_ephemeral_servers_on_a_fresh_home_start_on_the_seed(tmp_path):
    """Two `start_guarded_ephemeral_server` at once on a fresh home, the run's seed present: each
    server starts on a database already at head (copied once), and answers /health."""
    ensure_seed()  # the run's shared seed (tests/conftest.py), as the first start of a run makes it
    home = tmp_path / "prefect-home"
    start = textwrap.dedent(
        """
        import sqlite3, sys
        from pathlib import Path
        import httpx
        import infra.services.prefect_defaults
        from prefect.server.api.server import SubprocessASGIServer
        from infra.services.prefect_api import start_guarded_ephemeral_server

        database, started = Path(sys.argv[2]), SubprocessASGIServer.start

        def start_reporting(self, *args, **kwargs):
            with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as connection:
                print("revision", connection.execute("SELECT version_num FROM alembic_version").fetchone()[0])
            return started(self, *args, **kwargs)

        SubprocessASGIServer.start = start_reporting
        url = start_guarded_ephemeral_server(Path(sys.argv[1]))
        print("health", httpx.get(f"{url}/health", timeout=10).status_code, flush=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(home)
    logs = [tmp_path / f"server-{i}.log" for i in range(2)]
    servers = [
        subprocess.Popen(
            [sys.executable, "-c", start, str(log), str(home / "prefect.db")],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for log in logs
    ]
    outputs = [server.communicate(timeout=180)[0] for server in servers]
    assert [server.returncode for server in servers] == [0, 0], outputs
    for output in outputs:
        lines = output.splitlines()
        assert f"revision {head_revision()}" in lines and "health 200" in lines, output
    assert (home / "prefect.db").stat().st_nlink == 1  # the temporary name of the copy is gone
    for log in logs:
        text = log.read_text() if log.exists() else ""
        assert "Traceback" not in text and "Application startup failed" not in text, text[-3000:]
