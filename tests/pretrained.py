"""The demo's base model, pretrained once per test run for the tests that train from it
(`pretrained_tiny_model`), in the run's temporary directory that every pytest-xdist worker shares.

Whoever comes first pretrains, under a file lock, and the others read the same model: the first
test that needs it, or the process `start_in_background` starts as soon as a collection holds such
a test (`python -m tests.pretrained SHARED RUN_PID`), so the pretraining (40-130 s on 2 cores) runs
beside the first tests instead of holding every worker whose next test needs the model. That
process ends with the test run (pytest, or xdist's controller), not with the worker that started
it, which may end first. A pretraining that failed, or was killed before it ended, is not tried
again by each worker in turn: they fail at once with what `FAILED` holds.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
from pathlib import Path

from filelock import FileLock

from tests.helpers import REPO_ROOT

FAILED = "pretrained.failed"
"""Beside the model: why the shared pretraining did not end (absent when it ended or never began)."""


class PretrainingFailed(RuntimeError):
    """The shared pretraining failed, here or in another process; its message says how."""


def pretrained_model(shared: Path) -> Path:
    """The pretrained model in `shared`, pretrained here unless another process has (or is
    pretraining it now: this waits for its lock)."""
    from infra.run.config import load_config
    from rl.pretrain import pretrain

    path, failed, done = shared / "pretrained" / "base-model", shared / FAILED, shared / "pretrained.done"
    with FileLock(str(shared / "pretrained.lock")):
        if failed.exists():
            raise PretrainingFailed(f"the shared pretraining failed in another process: {failed.read_text()}")
        if not done.exists():
            config = load_config(None, {"pretrain.output": str(path), "model.path": str(path)})
            failed.write_text("it stopped before it ended (killed or timed out)")
            try:
                pretrain(config.pretrain, config.model)
            except Exception as error:
                failed.write_text(f"{type(error).__name__}: {error}")
                raise
            failed.unlink()
            done.touch()
    return path


def start_in_background(shared: Path, run_pid: int) -> subprocess.Popen:
    """`pretrained_model(shared)` in a process of its own, which ends when process `run_pid` (the
    test run) does (its output in `shared/pretraining.log`)."""
    shared.mkdir(parents=True, exist_ok=True)
    with open(shared / "pretraining.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.pretrained", str(shared), str(run_pid)], cwd=REPO_ROOT, stdout=log, stderr=log
        )


def exit_with(pid: int) -> None:
    """End this process (exit status 1) as soon as process `pid` has ended: a thread waits on its
    pidfd. A pretraining ended so leaves `FAILED` saying it stopped, and its lock free."""
    watched = os.pidfd_open(pid)

    def wait_and_exit() -> None:
        select.select([watched], [], [])
        print(f"the test run (pid {pid}) ended: exiting", flush=True)
        os._exit(1)

    threading.Thread(target=wait_and_exit, name="exit-with-the-run", daemon=True).start()


if __name__ == "__main__":
    import torch

    exit_with(int(sys.argv[2]))
    torch.set_num_threads(1)  # as in the tests' own processes (tests/conftest.py)
    print(f"the pretrained model: {pretrained_model(Path(sys.argv[1]))}", flush=True)
