"""Each tracker for real, read back with its own library: MLflow against a real `mlflow server` on
loopback and a local SQLite store (`MlflowClient`), TensorBoard event files (its
`EventAccumulator`), W&B offline run files (`wandb leet inspect --json`); a resumed run continues
the same tracker run; an MLflow server killed and restarted mid-run loses nothing after the restart,
and the training thread never waits for it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from infra.tracking.config import MlflowTracking, TensorboardTracking, WandbTracking
from infra.tracking.fanout import open_trackers
from infra.tracking.local_server import MlflowServer

pytestmark = pytest.mark.integration

RECORD = {
    "step": 0,
    "reward": 0.5,
    "accuracy": None,
    "tokens": 64,
    "version_lag_histogram": {"0": 64},
    "objective": "grpo",
}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with MlflowServer(tmp_path_factory.mktemp("mlflow-server")) as server:
        yield server


def _steps(trackers, steps) -> None:
    for step in steps:
        trackers.log_step(step, {**RECORD, "step": step, "reward": step / 10})


def _finish(trackers, tmp_path: Path, steps: int) -> dict:
    curves = tmp_path / "curves.png"
    _plot(curves)
    trackers.log_artifacts(curves, tmp_path / "checkpoints" / f"step_{steps:06d}")
    return trackers.finish(steps, {"final_reward": 0.4, "run": "x"})


def _plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(2, 2))
    plt.plot([0, 1], [0, 1])
    figure.savefig(path)
    plt.close(figure)


@pytest.mark.parametrize("store", ["server", "local"])
def test_mlflow_run_read_back_and_resumed(store, mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    settings = MlflowTracking(kind="mlflow", uri=mlflow_server.url if store == "server" else None)
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    trackers = open_trackers([settings], "mlf", tmp_path, first)
    trackers.log_params({"run": {"name": "mlf", "steps": 3}, "tracking": [{"kind": "mlflow"}]})
    _steps(trackers, [1, 2])
    counts = _finish(trackers, tmp_path, 2)
    assert counts["tracking_mlflow_dropped"] == 0 and counts["tracking_metrics_logged"] > 0

    resumed = open_trackers([settings], "mlf", tmp_path, second)  # the run resumed: same MLflow run
    _steps(resumed, [3])
    resumed.finish(3, {})

    state = json.loads((tmp_path / "tracking.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=state["uri"])
    run = client.get_run(state["run_id"])
    assert run.info.run_name == f"mlf-{first}"
    assert run.data.tags["prefect.flow_run_id"] == second
    assert run.data.tags["prefect.flow_run_ids"] == f"{first},{second}"
    assert run.data.params["run.steps"] == "3" and run.data.params["run.name"] == "mlf"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward")] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
    ]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "version_lag_histogram/0")] == [64.0] * 3
    assert "accuracy" not in run.data.metrics and "objective" not in run.data.metrics  # None, text
    assert run.data.metrics["summary/final_reward"] == 0.4
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"curves.png", "final_checkpoint.txt"} <= artifacts
    assert run.info.status == "FINISHED"


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flow_run = str(uuid.uuid4())
    trackers = open_trackers([TensorboardTracking(kind="tensorboard")], "tb", tmp_path, flow_run)
    trackers.log_params({"run": {"name": "tb"}})
    _steps(trackers, [1, 2, 3])
    _finish(trackers, tmp_path, 3)

    logdir = tmp_path / "tensorboard" / f"tb-{flow_run}"
    events = EventAccumulator(str(logdir), size_guidance={"images": 0, "tensors": 0, "scalars": 0})
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [e.value for e in events.Scalars("version_lag_histogram/0")] == [64.0] * 3
    assert "curves" in events.Tags()["images"]
    texts = events.Tags()["tensors"]
    assert {"prefect_flow_run_id/text_summary", "config/text_summary", "final_checkpoint/text_summary"} <= set(texts)
    flow_run_text = events.Tensors("prefect_flow_run_id/text_summary")[0].tensor_proto.string_val[0].decode()
    assert flow_run_text == flow_run


def test_wandb_offline_files_read_back(tmp_path):
    flow_run = str(uuid.uuid4())
    trackers = open_trackers([WandbTracking(kind="wandb", mode="offline", project="p")], "wb", tmp_path, flow_run)
    trackers.log_params({"run": {"name": "wb"}})
    _steps(trackers, [1, 2, 3])
    _finish(trackers, tmp_path, 3)

    (run_dir,) = (tmp_path / "wandb").glob(f"offline-run-*-{flow_run}")
    inspect = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    records = [
        json.loads(line)
        for line in subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.splitlines()
    ]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["_step"], h["reward"]) for h in history if "reward" in h] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["run_id"] == flow_run and run["display_name"] == f"wb-{flow_run}"
    summary = json.loads(
        subprocess.run(
            [*inspect[:-2], "--summary", "--json", str(run_dir)], capture_output=True, text=True, check=True
        ).stdout
    )
    assert summary["summary"]["final_checkpoint"] == str(tmp_path / "checkpoints" / "step_000003")
    assert summary["config"]["run.name"] == "wb" and summary["state"] == "finished"


def test_mlflow_server_killed_and_restarted_mid_run(mlflow_server, tmp_path):
    """Steps logged while the server is down are buffered and sent after its restart; logging a
    step never waits for the server (the training thread only appends to a buffer). The module's
    server is killed and restarted on its port and store (this test runs last in the module)."""
    from mlflow.tracking import MlflowClient

    server = mlflow_server
    trackers = open_trackers([MlflowTracking(kind="mlflow", uri=server.url)], "restart", tmp_path, str(uuid.uuid4()))
    _steps(trackers, range(1, 4))
    trackers.opened[0].channel.flush(30)
    server.stop()
    started = time.perf_counter()
    _steps(trackers, range(4, 8))  # the server is gone
    assert time.perf_counter() - started < 0.1
    server.start()
    _steps(trackers, range(8, 11))
    counts = trackers.finish(10, {})
    client = MlflowClient(tracking_uri=server.url)
    run_id = json.loads((tmp_path / "tracking.json").read_text())["mlflow"]["run_id"]
    assert [m.step for m in client.get_metric_history(run_id, "reward")] == list(range(1, 11))
    assert counts["tracking_mlflow_dropped"] == 0
    assert trackers.opened[0].channel.failures >= 1
