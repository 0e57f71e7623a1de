"""The Prefect UI in a real browser: headless Chromium opens a finished `rl-train` run on a local
stack (`infra.stack.up`), shows its Artifacts tab with the run's summary, steps table and progress,
and saves a screenshot to `artifacts/prefect-ui-run.png`.

Skipped when Chromium is not installed at /usr/bin/chromium (Debian: `apt-get install -y chromium`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.rl_train import rl_train
from infra.services.ports import free_port
from infra.stack.stack import down, up
from tests.helpers import REPO_ROOT, save_tiny_model, tiny_run, tiny_shape

CHROMIUM = Path("/usr/bin/chromium")
ROOT = REPO_ROOT
SCREENSHOT = ROOT / "artifacts" / "prefect-ui-run.png"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="Chromium is not installed at /usr/bin/chromium; install it with `apt-get install -y chromium` to check the Prefect UI in a browser",
    ),
]


def _chromium(url: str, *output: str) -> subprocess.CompletedProcess:
    """Render `url` headless (the UI is a single-page app: give it time to fetch and draw)."""
    return subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1600,1000",
            "--virtual-time-budget=20000",
            *output,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = up(state_dir=tmp_path_factory.mktemp("ui-stack"), port=free_port(), echo=lambda _: None)
    yield state
    down(state.state_dir, echo=lambda _: None)


def test_finished_run_shows_its_artifacts_in_the_ui(stack, tmp_path):
    base = tmp_path / "base"
    save_tiny_model(base, tiny_shape())
    overrides = tiny_run(base, tmp_path, "ui-check", 2, {"eval.every": 1, "fabric.enabled": False})
    with temporary_settings({PREFECT_API_URL: stack.api_url}):
        state = rl_train(overrides=overrides, return_state=True)
        # Deliver this process's queued events and logs to the stack now: it goes down after
        # this module, and a later drain (the session's test harness) would wait on it forever.
        EventsWorker.drain_all()
        APILogWorker.drain_all()
    assert state.is_completed(), state
    page = f"{stack.ui_url}/v2/runs/flow-run/{state.state_details.flow_run_id}?tab=Artifacts"  # the server's default UI

    dom = _chromium(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    for shown in ("rl-train", "Completed", "ui-check-summary", "ui-check-steps", "ui-check-progress"):
        assert shown in dom.stdout, f"{shown!r} is not on the rendered page {page}"

    SCREENSHOT.parent.mkdir(exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    shot = _chromium(page, f"--screenshot={SCREENSHOT}")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and SCREENSHOT.stat().st_size > 20_000
    print(f"screenshot of {page}: {SCREENSHOT}")
