"""Every failure `rlboost train` can name ends it with one line saying what and how to fix it, exit
status 2 (bad input, local state) or 3 (a service lost), and no traceback on the console: the real
CLI as a subprocess, on the tiny default configuration (the demo's fabric: a co-located reserved
instance and two spot workers) with small overrides, each failure made for real:

* a second driver of a run (another process holds its lock): refused before Prefect starts; two
  drivers of a run started at the same instant on a fresh Prefect home (one runs);
* an output directory on a read-only file system, or below a file (it cannot be made);
* the token log's Redis SIGKILLed mid-run: the co-located worker inside the training process
  prints nothing either, its traceback is in the run log with the run's; SIGKILLed before a
  version is published: its publication fails on the lost Redis, and ends the run the same way;
* a Redis URL whose port another service (HTTP) holds;
* Prefect: a database another Prefect version migrated, no free port for the ephemeral server
  (every port of its range held, in a private network namespace), a PREFECT_API_URL that does not
  answer.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from infra.run.redis_outage import public_url
from infra.services.ports import free_port
from infra.services.redis_embedded import EmbeddedRedis
from tests.helpers import REPO_ROOT, RESERVED_POOL, as_set_flags, on_a_small_disk, save_tiny_model, tiny_run, wait_for
from tests.infra.cli.test_prefect_home import OTHER_REVISION, _stamped_database

pytestmark = pytest.mark.integration

SMALL = {"eval.size": 4, "eval.every": 100, "rollout.prompts_per_step": 4, "rollout.group_size": 4}
"""Small overrides of the tiny run: every case fails at or after its start."""


@dataclass
class Case:
    """What one failure made for real printed and returned, and what it must have said."""

    returncode: int
    output: str
    code: int
    message: str
    """The start of the one line that names the failure."""
    run: Path
    """The run directory (its `driver.log` keeps the tracebacks)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("errors") / "base")


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory) -> Path:
    """One project Prefect home for the module's runs (its database migrated once)."""
    return tmp_path_factory.mktemp("prefect-home")


def _environment(tmp_path: Path, prefect_home: Path, **extra: str) -> dict[str, str]:
    """This session's environment without its Prefect configuration (each run starts its own
    ephemeral server in `prefect_home`), with a ledger of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "RLBOOST_REDIS_URL"}
    return {
        **env,
        "RLBOOST_PREFECT_HOME": str(prefect_home),
        "RLBOOST_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.sqlite'}",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **extra,
    }


def _train_command(model: Path, tmp_path: Path, **overrides: object) -> list[str]:
    run = tiny_run(model, tmp_path, "errors", 3, {**SMALL, **overrides})
    return [sys.executable, "-m", "infra.cli", "train", *as_set_flags(run)]


def _run(command: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)


def _case(done: subprocess.CompletedProcess, code: int, message: str, run: Path) -> Case:
    return Case(done.returncode, done.stdout + done.stderr, code, message, run)


# -- the failures ------------------------------------------------------------------------------


def second_driver(model: Path, tmp_path: Path, home: Path) -> Case:
    run = tmp_path / "runs" / "errors"
    run.mkdir(parents=True)
    hold = "import sys, time; from pathlib import Path; from infra.run.driver_lock import DriverLock; "
    hold += f"lock = DriverLock(Path({str(run)!r})); print('held', flush=True); time.sleep(600)"
    first = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "held"
        done = _run(_train_command(model, tmp_path), _environment(tmp_path, home))
    finally:
        first.kill()
        first.wait()
    assert not (run / "prefect-server.log").exists(), "Prefect started before the run lock was taken"
    assert "a second driver was refused" in (run / "driver.log").read_text()
    return _case(done, 2, f"run directory {run} is in use by another driver (pid {first.pid} host ", run)


def read_only_output_dir(model: Path, tmp_path: Path, home: Path) -> Case:
    disk = tmp_path / "disk"
    command = on_a_small_disk(
        disk, "64k", _train_command(model, tmp_path, **{"run.output_dir": str(disk)}), read_only=True
    )
    done = _run(command, _environment(tmp_path, home))
    run = disk / "errors"
    return _case(done, 2, f"cannot write the run directory {run} (Read-only file system: {disk}", run)


def output_dir_below_a_file(model: Path, tmp_path: Path, home: Path) -> Case:
    (tmp_path / "a-file").write_text("not a directory")
    output = tmp_path / "a-file" / "runs"
    done = _run(_train_command(model, tmp_path, **{"run.output_dir": str(output)}), _environment(tmp_path, home))
    return _case(done, 2, f"cannot write the run directory {output / 'errors'} (Not a directory: ", output / "errors")


def lost_redis(model: Path, tmp_path: Path, home: Path) -> Case:
    server = EmbeddedRedis()
    server.start()
    where = public_url(server.url)
    run = tmp_path / "runs" / "errors"
    env = _environment(tmp_path, home, RLBOOST_REDIS_URL=server.url)  # not on the command line: it holds the password
    reserved = {**RESERVED_POOL, "colocated": True}  # the demo's co-located instance alone: a faster first step
    overrides = {"run.checkpoint_every": 1, "fabric.redis_outage_timeout_s": 3, "fabric.pools": [reserved]}
    command = _train_command(model, tmp_path, **overrides)
    driver = subprocess.Popen(
        command, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        checkpoint = run / "checkpoints" / "step_000001"
        wait_for(lambda: checkpoint.exists() or driver.poll() is not None, "the first checkpoint", timeout_s=240)
        os.kill(server.pid, signal.SIGKILL)
        output, _ = driver.communicate(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
        server.stop()
    assert server.password not in output
    log = (run / "driver.log").read_text()
    assert "worker reserved-colocated failed" in log and "Traceback" in log  # the co-located worker's, kept here
    assert "the run ended with: RunStopped(" in log
    return Case(
        driver.returncode, output, 3, f"the run stopped: the token log's Redis at {where} has not answered", run
    )


def lost_redis_at_publish(model: Path, tmp_path: Path, home: Path) -> Case:
    """Redis SIGKILLed once step 1's rollout is written: the step scores and trains without it, and
    the publication of version 1 meets a Redis that is gone (`Error 111 connecting`)."""
    server = EmbeddedRedis()
    server.start()
    where = public_url(server.url)
    run = tmp_path / "runs" / "errors"
    env = _environment(tmp_path, home, RLBOOST_REDIS_URL=server.url)
    reserved = {**RESERVED_POOL, "colocated": True}
    overrides = {"fabric.redis_outage_timeout_s": 3, "fabric.pools": [reserved]}
    driver = subprocess.Popen(
        _train_command(model, tmp_path, **overrides),
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        rollout = run / "steps" / "000001" / "rollout.jsonl"
        wait_for(lambda: rollout.exists() or driver.poll() is not None, "step 1's rollout", timeout_s=240)
        os.kill(server.pid, signal.SIGKILL)
        output, _ = driver.communicate(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
        server.stop()
    log = (run / "driver.log").read_text()
    assert "infra.weights.publisher: weight publication failed" in log, "the publication met a live Redis"
    assert "closing the weights publisher: weight publication failed: Error 111 connecting" in log
    assert "the run ended with: RunStopped(" in log
    return Case(
        driver.returncode, output, 3, f"the run stopped: the token log's Redis at {where} has not answered", run
    )


def redis_port_held_by_another_service(model: Path, tmp_path: Path, home: Path) -> Case:
    class Quiet(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    http = HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    port = http.server_address[1]
    try:
        url = f"redis://127.0.0.1:{port}/0"
        done = _run(_train_command(model, tmp_path, **{"fabric.redis_url": url}), _environment(tmp_path, home))
    finally:
        http.shutdown()
    run = tmp_path / "runs" / "errors"
    assert "the run ended with: RedisUnavailable(" in (run / "driver.log").read_text()
    message = f"cannot run: cannot reach Redis at 127.0.0.1:{port} (InvalidResponse: "
    assert "start that server or fix fabric.redis_url" in done.stdout
    return _case(done, 3, message, run)


def prefect_database_of_another_version(model: Path, tmp_path: Path, home: Path) -> Case:
    own_home = tmp_path / "prefect-home"
    stamped = _stamped_database(own_home / "prefect.db")
    done = _run(_train_command(model, tmp_path), _environment(tmp_path, own_home))
    message = f"cannot start the embedded Prefect server: the Prefect database {stamped} carries migration revision '{OTHER_REVISION}'"
    return _case(done, 2, message, tmp_path / "runs" / "errors")


def prefect_without_a_free_port(model: Path, tmp_path: Path, home: Path) -> Case:
    if not shutil.which("unshare") or subprocess.run(["unshare", "-rn", "true"]).returncode:
        pytest.skip("cannot make a private network namespace here (unshare -rn)")
    hold_every_port = textwrap.dedent(
        """
        import socket, subprocess, sys
        held = []
        for port in range(8000, 9000):  # Prefect's range for its ephemeral server
            held.append(socket.socket())
            held[-1].bind(("127.0.0.1", port))
            held[-1].listen()
        sys.exit(subprocess.run(sys.argv[1:]).returncode)
        """
    )
    command = [
        "unshare",
        "-rn",
        "sh",
        "-c",
        'ip link set lo up && exec "$@"',
        "sh",
        sys.executable,
        "-c",
        hold_every_port,
    ]
    done = _run([*command, *_train_command(model, tmp_path)], _environment(tmp_path, home))
    run = tmp_path / "runs" / "errors"
    assert "the run ended with: PrefectServerCannotStart(" in (run / "driver.log").read_text()
    message = "the embedded Prefect server needs a free port on 127.0.0.1 in 8000-8999 (Prefect's range) and every one is in use"
    return _case(done, 3, message, run)


def prefect_api_that_does_not_answer(model: Path, tmp_path: Path, home: Path) -> Case:
    api = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    done = _run(_train_command(model, tmp_path), _environment(tmp_path, home, PREFECT_API_URL=api))
    message = f"cannot reach the Prefect API at {api} (PREFECT_API_URL) for rlboost train: ConnectError"
    return _case(done, 3, message, tmp_path / "runs" / "errors")


def drivers_started_at_the_same_instant(model: Path, tmp_path: Path, home: Path) -> Case:
    """Two drivers of one run at once, on a Prefect home not migrated yet: one is refused before it
    starts Prefect, the other completes the run."""
    fresh = _environment(tmp_path, tmp_path / "fresh-prefect-home")
    quick = {"fabric.enabled": False, "run.steps": 1, "run.checkpoint_every": 1, "eval.every": 1}
    drivers = [
        subprocess.Popen(
            _train_command(model, tmp_path, **quick),
            env=fresh,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outputs = [driver.communicate(timeout=240)[0] for driver in drivers]
    finally:
        for driver in drivers:
            if driver.poll() is None:
                driver.kill()
    codes = [driver.returncode for driver in drivers]
    refused = codes.index(2) if 2 in codes else 0
    ran = 1 - refused
    assert codes[ran] == 0 and "Traceback" not in outputs[ran], outputs[ran][-6000:]
    run = tmp_path / "runs" / "errors"
    message = f"run directory {run} is in use by another driver (pid {drivers[ran].pid} host "
    return Case(codes[refused], outputs[refused], 2, message, run)


CLASSES: dict[str, Callable[[Path, Path, Path], Case]] = {
    "drivers started at the same instant": drivers_started_at_the_same_instant,
    "second driver": second_driver,
    "read-only output directory": read_only_output_dir,
    "output directory that cannot be made": output_dir_below_a_file,
    "lost Redis": lost_redis,
    "Redis lost while a version is published": lost_redis_at_publish,
    "Redis port held by another service": redis_port_held_by_another_service,
    "Prefect database of another version": prefect_database_of_another_version,
    "no free port for the Prefect server": prefect_without_a_free_port,
    "Prefect API that does not answer": prefect_api_that_does_not_answer,
}


@pytest.mark.parametrize("failure", list(CLASSES))
def test_a_failure_the_program_names_is_one_line_and_its_exit_status(failure, model, prefect_home, tmp_path):
    case = CLASSES[failure](model, tmp_path, prefect_home)
    print(case.output[-3000:])
    lines = [line for line in case.output.splitlines() if line.strip()]
    assert case.returncode == case.code, case.output[-4000:]
    assert "Traceback" not in case.output, case.output[-6000:]
    assert lines and lines[-1].startswith(case.message), lines[-3:]
    assert sum(case.message in line for line in lines) == 1, "the failure is said once"
