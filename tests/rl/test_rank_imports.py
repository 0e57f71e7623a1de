"""What a DeepSpeed trainer rank imports: DeepSpeed without MLflow (its autotuner would import
MLflow and pandas in every rank, about 1 s of CPU each, for autotuning the ranks never run), while
MLflow itself still imports afterwards."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROBE = """
import sys
from rl.distributed.rank import import_deepspeed
deepspeed = import_deepspeed()
print("mlflow" in sys.modules, "pandas" in sys.modules, deepspeed.autotuning.autotuner.has_mlflow)
import mlflow
print(mlflow.__name__)
"""


def test_deepspeed_is_imported_without_mlflow_and_mlflow_still_imports():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-2:] == ["False False False", "mlflow"]  # DeepSpeed logs to stdout before
