"""`rlboost` keeps its ephemeral Prefect server in a home of its own (`.rlboost/prefect`, or
`$RLBOOST_PREFECT_HOME`): a `~/.prefect` that another Prefect version migrated is neither read nor
touched, and a home whose database another version migrated stops the command with one line
(which database, which Prefect, which revision, the fix), not tracebacks. Real Prefect throughout:
the commands run as subprocesses with their own HOME."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import prefect
import pytest

from infra.services.prefect_home import HOME_ENV, database_problem, known_revisions, own_prefect, sqlite_path
from tests.helpers import as_set_flags, save_tiny_model, tiny_run

OTHER_REVISION = "27d8f4e1a6c9"
"""The revision that Prefect 3.9.1 migrates its SQLite database to, unknown to Prefect 3.7."""
SHORT_RUN = {"fabric.enabled": False, "rollout.prompts_per_step": 2, "rollout.group_size": 2, "eval.every": 100}


def _stamped_database(path: Path, revision: str = OTHER_REVISION) -> Path:
    """A Prefect SQLite database as another Prefect version leaves it, as far as a starting server
    reads it: alembic's version table (as alembic creates it) at `revision`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as connection:
        connection.execute(
            "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
            "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"
        )
        connection.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
        connection.execute("CREATE TABLE flow (id CHAR(36) NOT NULL PRIMARY KEY, name VARCHAR NOT NULL)")
    connection.close()
    return path


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.rglob("*")}


def _environment(home: Path, **extra: str) -> dict[str, str]:
    """This session's environment less any Prefect configuration, with `home` as HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != HOME_ENV}
    return {**env, "HOME": str(home), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", **extra}


def _rlboost(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "infra.cli", *args]
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_a_database_of_another_prefect_version_is_named_with_its_revision_and_the_fix(tmp_path):
    stamped = _stamped_database(tmp_path / "prefect.db")
    problem = database_problem(f"sqlite+aiosqlite:///{stamped}", "3.7.7", "set RLBOOST_PREFECT_HOME elsewhere")
    assert f"the Prefect database {stamped} carries migration revision '{OTHER_REVISION}'" in problem
    assert "Prefect 3.7.7 does not know" in problem
    assert f"move it aside (e.g. `mv {stamped} {stamped}.old`) or set RLBOOST_PREFECT_HOME elsewhere" in problem
    assert "\n" not in problem

    known = _stamped_database(tmp_path / "known.db", revision=sorted(known_revisions())[0])
    assert database_problem(f"sqlite+aiosqlite:///{known}", "3.7.7", "-") is None  # Prefect migrates it on
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database" * 400)
    assert "cannot be read (file is not a database)" in database_problem(f"sqlite:///{garbage}", "3.7.7", "-")
    assert database_problem(f"sqlite+aiosqlite:///{tmp_path / 'none.db'}", "3.7.7", "-") is None
    assert database_problem("postgresql+asyncpg://u:p@db:5432/prefect", "3.7.7", "-") is None
    assert sqlite_path("sqlite+aiosqlite:///relative/prefect.db") == Path("relative/prefect.db")


def test_a_user_who_configured_prefect_keeps_it(tmp_path):
    home = tmp_path / "home"
    assert own_prefect({"HOME": str(home)}) is None
    assert own_prefect({"PREFECT_API_URL": "http://127.0.0.1:4200/api"}) == "$PREFECT_API_URL"
    assert own_prefect({"PREFECT_HOME": "/elsewhere"}) == "$PREFECT_HOME"
    profiles = home / ".prefect" / "profiles.toml"
    profiles.parent.mkdir(parents=True)
    profiles.write_text('active = "local"\n')  # Prefect's bundled `local` profile names a server
    assert own_prefect({"HOME": str(home)}) == "PREFECT_API_URL in the active profile of ~/.prefect/profiles.toml"
    profiles.write_text('active = "ephemeral"\n')
    assert own_prefect({"HOME": str(home)}) is None


@pytest.mark.integration
def test_the_command_line_sets_the_home_before_prefect_reads_it(tmp_path):
    """A fresh interpreter each: Prefect reads PREFECT_HOME when imported."""
    code = (
        "import sys\nfrom infra.cli.app import app\nassert 'prefect' not in sys.modules\n"
        "sys.argv = ['rlboost', 'train', '--help']\ntry:\n    app()\nexcept SystemExit:\n    pass\n"
        "from prefect.settings import get_current_settings as s\nprint('HOME', s().home, s().server.memo_store_path)"
    )

    def home_of(**extra: str) -> list[str]:
        env = _environment(tmp_path / "home", **extra)
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()[-1].split()[1:]

    ours = tmp_path / ".rlboost" / "prefect"
    assert home_of() == [str(ours), str(ours / "memo_store.toml")]
    assert home_of(RLBOOST_PREFECT_HOME=str(tmp_path / "mine"))[0] == str(tmp_path / "mine")
    assert home_of(PREFECT_API_URL="http://127.0.0.1:9/api")[0] == str(tmp_path / "home" / ".prefect")


@pytest.mark.integration
@pytest.mark.slow
def test_train_never_touches_a_home_prefect_of_another_version(tmp_path):
    """A `~/.prefect/prefect.db` another Prefect migrated: `rlboost train` succeeds on the project's
    own home and leaves every file of `~/.prefect` as it was."""
    user_prefect = tmp_path / "home" / ".prefect"
    _stamped_database(user_prefect / "prefect.db")
    before = _snapshot(user_prefect)
    model = save_tiny_model(tmp_path / "base")
    args = ["train", *as_set_flags(tiny_run(model, tmp_path, "home", overrides=SHORT_RUN))]
    done = _rlboost(args, _environment(tmp_path / "home"), cwd=tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert _snapshot(user_prefect) == before
    assert (tmp_path / ".rlboost" / "prefect" / "prefect.db").is_file()  # the project's own, beside its data
    assert (tmp_path / "runs" / "home" / "checkpoints").is_dir()


@pytest.mark.integration
@pytest.mark.parametrize("command", ["train", "demo"])
def test_a_project_home_of_another_version_stops_the_command_with_one_line(tmp_path, command):
    """`demo` says so before pretraining (its base model is missing here), `train` before its run."""
    stamped = _stamped_database(tmp_path / "prefect-home" / "prefect.db")
    before = stamped.read_bytes()
    base = tmp_path / "base"
    sets = tiny_run(base, tmp_path, "home", overrides={"pretrain.output": str(base), **SHORT_RUN})
    env = _environment(tmp_path / "home", RLBOOST_PREFECT_HOME=str(tmp_path / "prefect-home"))
    done = _rlboost([command, *as_set_flags(sets)], env, cwd=tmp_path, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert lines[-1] == (
        f"cannot start the embedded Prefect server: the Prefect database {stamped} carries migration revision "
        f"'{OTHER_REVISION}', which the installed Prefect {prefect.__version__} does not know: another (likely newer) "
        f"Prefect version migrated it; move it aside (e.g. `mv {stamped} {stamped}.old`) or set RLBOOST_PREFECT_HOME "
        "to another directory, or run the Prefect version that migrated it"
    )
    if command == "train":
        assert len(lines) == 1, lines  # (demo prints its plan and estimate first)
    assert stamped.read_bytes() == before
    assert not base.exists() and not (tmp_path / "runs").exists()  # nothing pretrained, no run begun


@pytest.mark.integration
@pytest.mark.slow
def test_a_server_that_cannot_start_is_one_line_naming_its_log(tmp_path):
    """A database Prefect's server cannot open (its path is a directory): after the second start
    attempt, one line with the Prefect version, the database and the log; the tracebacks in the log."""
    home = tmp_path / "prefect-home"
    (home / "prefect.db").mkdir(parents=True)
    model = save_tiny_model(tmp_path / "base")
    args = ["train", *as_set_flags(tiny_run(model, tmp_path, "home", overrides=SHORT_RUN))]
    done = _rlboost(args, _environment(tmp_path / "home", RLBOOST_PREFECT_HOME=str(home)), cwd=tmp_path)
    log = tmp_path / "runs" / "home" / "prefect-server.log"
    assert done.returncode == 3, done.stdout + done.stderr  # a service the run needs cannot be had
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"the embedded Prefect server (Prefect {prefect.__version__}, database sqlite+aiosqlite:///{home}/prefect.db) "
        "did not start: RuntimeError: the server exited during start-up 2 times; its log: "
        f"{log}. Point PREFECT_API_URL at a running server (`rlboost up`), or set RLBOOST_PREFECT_HOME to another "
        "directory for a fresh database"
    ]
    text = log.read_text()
    assert text.count("Application startup failed") == 2 and "unable to open database file" in text
    assert "Traceback" in text


def test_up_on_a_database_of_another_version_says_so_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from infra.cli.app import app
    from infra.stack.stack import StackState

    stamped = _stamped_database(tmp_path / "prefect.db")
    result = CliRunner().invoke(app, ["up", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert f"rlboost up failed: the Prefect database {stamped} carries migration revision '{OTHER_REVISION}'" in text
    assert f"move it aside (e.g. `mv {stamped} {stamped}.old`) or use another --state-dir" in text
    state = StackState.load(tmp_path)
    assert state is None or state.running() == []
