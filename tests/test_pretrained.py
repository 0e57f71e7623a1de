"""The shared pretraining of `pretrained_tiny_model` (`tests.pretrained`): a pretraining that failed
or was killed elsewhere fails the next taker at once, with its reason, and pretrains nothing; the
background pretraining ends with the test run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rl.driver_watch import DRIVER_PID_ENV, EXIT_DRIVER_GONE
from tests.helpers import REPO_ROOT
from tests.pretrained import FAILED, PretrainingFailed, pretrained_model

WATCHER = "import time; from tests.pretrained import end_with_the_run; end_with_the_run(); print('watching', flush=True); time.sleep(120)"


def test_a_pretraining_that_failed_elsewhere_fails_at_once_with_its_reason(tmp_path):
    (tmp_path / FAILED).write_text("it stopped before it ended (killed or timed out)")
    with pytest.raises(PretrainingFailed, match="killed or timed out"):
        pretrained_model(tmp_path)
    assert not (tmp_path / "pretrained").exists()


def test_the_background_pretraining_ends_with_the_test_run():
    """`tests.pretrained` ends as soon as the process it was tied to (the test run) has ended, not
    at the end of its pretraining: here a process waiting on a stand-in for the run."""
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCHER],
        cwd=REPO_ROOT,
        env={**os.environ, DRIVER_PID_ENV: str(run.pid)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None and watcher.stdout.readline().strip() == "watching"
        assert watcher.poll() is None
        run.kill()
        run.wait()
        assert watcher.wait(timeout=30) == EXIT_DRIVER_GONE
        assert watcher.stderr is not None and f"the driver (pid {run.pid}) is gone" in watcher.stderr.read()
    finally:
        for process in (run, watcher):
            if process.poll() is None:
                process.kill()
                process.wait()
