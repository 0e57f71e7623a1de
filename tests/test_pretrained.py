"""The shared pretraining of `pretrained_tiny_model` (`tests.pretrained`): a pretraining that failed
or was killed elsewhere fails the next taker at once, with its reason, and pretrains nothing; the
background pretraining ends with the test run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT
from tests.pretrained import FAILED, PretrainingFailed, pretrained_model

WATCHER = "import sys, time; from tests.pretrained import exit_with; exit_with(int(sys.argv[1])); print('watching', flush=True); time.sleep(120)"


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
        [sys.executable, "-c", WATCHER, str(run.pid)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert watcher.stdout is not None and watcher.stdout.readline().strip() == "watching"
        assert watcher.poll() is None
        run.kill()
        run.wait()
        assert watcher.wait(timeout=30) == 1
        assert "ended: exiting" in watcher.stdout.read()
    finally:
        for process in (run, watcher):
            if process.poll() is None:
                process.kill()
                process.wait()
