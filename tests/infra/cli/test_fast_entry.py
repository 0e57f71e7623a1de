"""The command line, the configuration models and the simulator load without torch or transformers,
and the configuration models and the simulator without any runtime (Redis, NumPy, PyArrow,
SQLAlchemy, Prefect, the token log): a fresh interpreter each, since the test session itself has
imported them all."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

HEAVY = ("torch", "transformers")
RUNTIME = ("redis", "numpy", "pyarrow", "sqlalchemy", "prefect", "infra.rollout.tokenlog")
CONFIGURATION = (
    "infra.run.config",
    "infra.run.fabric_config",
    "infra.rollout.settings",
    "infra.rollout.controller_config",
    "rl.config",
    "rl.generation",
    "rl.engine_spec",
)


def loaded(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return out.stdout


@pytest.mark.parametrize("module", ["infra.cli.app", "infra.run.config", "infra.rollout.settings", "rl.generation"])
def test_importing_loads_no_torch(module):
    assert loaded(f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))").strip() == "[]"


@pytest.mark.parametrize("module", CONFIGURATION)
def test_a_configuration_model_loads_no_runtime(module):
    assert loaded(f"import sys, {module}; print(sorted(m for m in {RUNTIME!r} if m in sys.modules))").strip() == "[]"


def test_every_simulator_module_loads_no_runtime():
    code = (
        "import importlib, pkgutil, sys, infra.sim\n"
        "for module in pkgutil.iter_modules(infra.sim.__path__):\n"
        "    importlib.import_module('infra.sim.' + module.name)\n"
        f"print(sorted(m for m in {RUNTIME + HEAVY!r} if m in sys.modules))"
    )
    assert loaded(code).strip() == "[]"


def test_help_loads_no_torch_redis_numpy_pyarrow_or_token_log():
    """`rlboost --help` (`rlboost cost`'s module loads the ledger, so SQLAlchemy is not checked here)."""
    unwanted = HEAVY + ("redis", "numpy", "pyarrow", "infra.rollout.tokenlog")
    code = (
        "import sys; sys.argv = ['rlboost', '--help']\nfrom infra.cli.app import app\ntry:\n    app()\n"
        f"except SystemExit:\n    pass\nprint('LOADED', sorted(m for m in {unwanted!r} if m in sys.modules))"
    )
    out = loaded(code)
    assert "LOADED []" in out and "Usage" in out
