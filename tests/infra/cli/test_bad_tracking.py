"""A `tracking:` entry that cannot work is refused by the real `rlboost train` before any work: one
line naming the entry and the fix, exit status 2, no run directory, no Prefect (an unknown kind, a
tracker whose library is missing, an MLflow server that does not answer); with `required: false` the
unanswered server is a warning (`check_tracking` returns it, and the run goes on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.tracking.config import MlflowTracking
from infra.tracking.local_server import free_port
from infra.tracking.preflight import check_tracking
from tests.helpers import REPO_ROOT, as_set_flags, save_tiny_model, tiny_run

HIDE_MLFLOW = 'import sys\n\nsys.modules["mlflow"] = None  # find_spec("mlflow") is None, import mlflow fails\n'
"""A `sitecustomize` that makes `mlflow` look uninstalled to the process."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bad-tracking") / "base")


def _train(model: Path, tmp_path: Path, tracking: list, env: dict[str, str] | None = None):
    run = tiny_run(model, tmp_path, "bad-tracking", 1, {"fabric.enabled": False, "tracking": tracking})
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "RLBOOST_REDIS_URL"}
    clean |= {"RLBOOST_PREFECT_HOME": str(tmp_path / "prefect-home"), **(env or {})}
    command = [sys.executable, "-m", "infra.cli", "train", *as_set_flags(run)]
    return subprocess.run(command, env=clean, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def _refused(done, tmp_path: Path) -> list[str]:
    assert done.returncode == 2, done.stdout + done.stderr
    assert not (tmp_path / "runs").exists(), "the run directory was made"
    assert not (tmp_path / "prefect-home" / "prefect.db").exists(), "Prefect started"
    return [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


@pytest.mark.integration  # the real `rlboost train`, a process of its own
def test_an_unknown_tracker_kind(model, tmp_path):
    lines = _refused(_train(model, tmp_path, [{"kind": "mlflw"}]), tmp_path)
    assert lines == [
        "configuration error",
        "override tracking: tracking.0: Value error, unknown tracker kind 'mlflw': set kind to one of mlflow, "
        "tensorboard, wandb (docs/tracking.md)",
    ]


@pytest.mark.integration  # the real `rlboost train`, a process of its own
def test_a_missing_library(model, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HIDE_MLFLOW)
    done = _train(model, tmp_path, [{"kind": "mlflow"}], {"PYTHONPATH": str(tmp_path / "site")})
    assert _refused(done, tmp_path) == [
        "cannot start the run",
        "tracking[0].kind: the mlflow tracker needs the mlflow library: pip install 'rlboost[mlflow]' (or remove "
        "this entry from tracking)",
    ]


@pytest.mark.integration  # the real `rlboost train`, a process of its own
def test_an_unreachable_mlflow_server(model, tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    lines = _refused(_train(model, tmp_path, [{"kind": "mlflow", "uri": uri}]), tmp_path)
    assert lines == [
        "cannot start the run",
        f"tracking[0].uri: no MLflow server answers at {uri} (Connection refused): start it (`mlflow server "
        "--host 127.0.0.1 --port 5000`), fix the uri, or leave uri out for a local store in the run's directory",
    ]


def test_an_unreachable_server_not_required_is_a_warning():
    uri = f"http://127.0.0.1:{free_port()}"
    (warning,) = check_tracking([MlflowTracking(kind="mlflow", uri=uri, required=False)])
    assert warning.startswith(f"tracking[0].uri: no MLflow server answers at {uri}")
    assert warning.endswith("tracking[0].required is false: the run goes on, the tracker retries")
