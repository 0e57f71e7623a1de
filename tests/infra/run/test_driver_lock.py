"""One run directory, one driver: a second training session of a run directory is refused with the
pid and host of the first, a lock whose holder was SIGKILLed is free at once, and the lock
`rlboost train` takes before Prefect starts is its session's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from infra.run.config import parse_config
from infra.run.driver_lock import DriverLock, RunLocked, hold_for_session, release_unclaimed, session_lock
from infra.run.session import TrainingSession
from tests.helpers import save_tiny_model, tiny_run


def test_a_second_session_of_a_run_is_refused_naming_the_first(tmp_path):
    overrides = tiny_run(
        save_tiny_model(tmp_path / "model"),
        tmp_path,
        steps=None,
        overrides={
            "run.torch_threads": 1,
            "eval.size": 2,
            "fabric.enabled": False,
            "ledger.url": f"sqlite:///{tmp_path / 'ledger.db'}",
        },
    )
    config = parse_config("", overrides=overrides)
    first = TrainingSession(config)
    try:
        holder = f"pid {os.getpid()} host {socket.gethostname()}"
        with pytest.raises(RunLocked, match=rf"{config.run.directory} is in use by another driver \({holder}\)"):
            TrainingSession(config)
    finally:
        first.close()
    TrainingSession(config).close()  # closed: the run is free again


def test_a_lock_left_by_a_sigkilled_driver_is_free(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import time
                from pathlib import Path
                from infra.run.driver_lock import DriverLock
                lock = DriverLock(Path({str(tmp_path)!r}))
                print("held", flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[3],
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=rf"\(pid {holder.pid} host "):
            DriverLock(tmp_path)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    lock = DriverLock(tmp_path)
    assert (tmp_path / "driver.lock").read_text() == f"pid {os.getpid()} host {socket.gethostname()}\n"
    lock.release()


def test_the_lock_rlboost_train_takes_is_handed_to_its_session_once(tmp_path):
    """`rlboost train` takes the lock before Prefect starts (`hold_for_session`); the session it opens
    takes that lock over, a second session of the run is refused, and a lock no session took is
    freed (`release_unclaimed`)."""
    held = hold_for_session(tmp_path)
    with pytest.raises(RunLocked):
        DriverLock(tmp_path)  # another driver
    assert session_lock(tmp_path) is held
    with pytest.raises(RunLocked):
        session_lock(tmp_path)  # handed over once
    held.release()
    hold_for_session(tmp_path)
    release_unclaimed(tmp_path)
    DriverLock(tmp_path).release()  # free again
