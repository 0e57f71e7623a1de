"""A real rl-train run (two tiny steps) with all three trackers: its steps reach a real MLflow
server, TensorBoard and W&B offline, the MLflow run carries the Prefect flow run's id, and the
flow run's page links to it. Then headless Chromium opens the run in MLflow's UI (its name, tags and
step metrics) and saves `artifacts/mlflow-ui-run.png` (ignored by git; docs/mlflow-ui-run.png is a
copy of one; skipped without /usr/bin/chromium: `apt-get install -y chromium`). The UI's run page needs graphene 3 (graphene 2 fails on graphql-core 3)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from flows.rl_train import rl_train
from infra.tracking.local_server import MlflowServer
from tests.helpers import REPO_ROOT, save_tiny_model, tiny_run

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = REPO_ROOT / "artifacts" / "mlflow-ui-run.png"


@pytest.fixture(scope="module")
def tracked_run(prefect_harness, tmp_path_factory):
    """(MLflow server, the finished run's state, its directory)."""
    root = tmp_path_factory.mktemp("tracked")
    with MlflowServer(root / "mlflow") as server:
        tracking = [
            {"kind": "mlflow", "uri": server.url},
            {"kind": "tensorboard"},
            {"kind": "wandb", "mode": "offline", "project": "rlboost-test"},
        ]
        overrides = tiny_run(
            save_tiny_model(root / "base"), root, "track", 2, {"fabric.enabled": False, "tracking": tracking}
        )
        state = rl_train(overrides=overrides, return_state=True)
        yield server, state, root / "runs" / "track"


def test_the_steps_reach_every_tracker_with_the_flow_run_id(tracked_run):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    server, state, run_dir = tracked_run
    assert state.is_completed(), state
    flow_run_id = str(state.state_details.flow_run_id)
    summary = state.result()
    assert summary["tracking_mlflow_dropped"] == summary["tracking_wandb_dropped"] == 0

    saved = json.loads((run_dir / "tracking.json").read_text())
    client = MlflowClient(tracking_uri=server.url)
    run = client.get_run(saved["mlflow"]["run_id"])
    assert run.info.run_name == f"track-{flow_run_id}" and run.data.tags["prefect.flow_run_id"] == flow_run_id
    records = [json.loads((run_dir / "steps" / f"{s:06d}" / "metrics.json").read_text()) for s in (1, 2)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward")] == [
        (r["step"], r["reward"]) for r in records
    ]
    for column in ("tokens_per_s", "step_s", "cost_usd", "version_lag_mean", "is_weight_mean", "policy_version"):
        assert len(client.get_metric_history(run.info.run_id, column)) == 2, column
    assert run.data.params["run.name"] == "track" and run.data.params["tracking"].startswith("[")
    assert {"curves.png", "final_checkpoint.txt"} <= {a.path for a in client.list_artifacts(run.info.run_id)}

    events = EventAccumulator(str(Path(saved["tensorboard"]["logdir"])))
    events.Reload()
    assert [e.step for e in events.Scalars("reward")] == [1, 2]
    assert list((run_dir / "wandb").glob(f"offline-run-*-{flow_run_id}/run-{flow_run_id}.wandb"))

    async def link():
        async with get_client() as prefect:
            return await prefect.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["track-mlflow"]))
            )

    (artifact,) = asyncio.run(link())
    assert artifact.type == "markdown" and run.info.run_id in str(artifact.data)  # a link artifact is markdown
    assert str(artifact.flow_run_id) == flow_run_id


@pytest.mark.skipif(
    not CHROMIUM.exists(), reason="Chromium is not installed at /usr/bin/chromium (apt-get install -y chromium)"
)
def test_mlflow_ui_shows_the_runs_steps(tracked_run):
    server, state, run_dir = tracked_run
    saved = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    page = f"{server.url}/#/experiments/{saved['experiment_id']}/runs/{saved['run_id']}"
    dom = _chromium(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    for shown in (f"track-{state.state_details.flow_run_id}", "prefect.flow_run_id", "reward", "tokens_per_s"):
        assert shown in dom.stdout, f"{shown!r} is not on the rendered page {page}"
    SCREENSHOT.parent.mkdir(exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    shot = _chromium(page, f"--screenshot={SCREENSHOT}")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and SCREENSHOT.stat().st_size > 20_000
    print(f"screenshot of {page}: {SCREENSHOT}")


def _chromium(url: str, *output: str) -> subprocess.CompletedProcess:
    """Render `url` headless (a single-page app: give it time to fetch and draw)."""
    return subprocess.run(
        [
            *(str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"),
            *("--window-size=1400,1500", "--virtual-time-budget=30000", *output, url),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
