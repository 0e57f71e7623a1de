"""The demo's base model, pretrained once per test run for the tests that train from it
(`pretrained_tiny_model`), in the run's temporary directory that every pytest-xdist worker shares.

Whoever comes first pretrains, under a file lock, and the others read the same model: the first
test that needs it, or the process `start_in_background` starts as soon as a collection holds such
a test (`python -m tests.pretrained SHARED`), so the pretraining (40-130 s on 2 cores) runs beside
the first tests instead of holding every worker whose next test needs the model. That process ends
with the test run (pytest, or xdist's controller), not with the worker that started it, which may
end first: it watches the run as a rollout worker watches its driver (`rl.driver_watch`). A
pretraining that failed, or was killed before it ended, is not tried again by each worker in turn:
they fail at once with what `FAILED` holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

from rl.driver_watch import DRIVER_PID_ENV, watch_driver
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
            [sys.executable, "-m", "tests.pretrained", str(shared)],
            cwd=REPO_ROOT,
            env={**os.environ, DRIVER_PID_ENV: str(run_pid)},
            stdout=log,
            stderr=log,
        )


def end_with_the_run() -> None:
    """End this process as soon as the test run named in its environment has ended (nothing to hand
    back: a pretraining ended so leaves `FAILED` saying it stopped, and its lock free)."""
    watch_driver(lambda: None, grace_s=0.0)


if __name__ == "__main__":
    import torch

    end_with_the_run()
    torch.set_num_threads(1)  # as in the tests' own processes (tests/conftest.py)
    print(f"the pretrained model: {pretrained_model(Path(sys.argv[1]))}", flush=True)
