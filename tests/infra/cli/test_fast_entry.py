"""The command line and the configuration models load without torch or transformers (a fresh
interpreter each, since the test session itself has imported them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

HEAVY = ("torch", "transformers")


@pytest.mark.parametrize("module", ["infra.cli.app", "infra.run.config", "infra.rollout.settings", "rl.generation"])
def test_importing_loads_no_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_help_loads_no_torch():
    code = (
        "import sys; sys.argv = ['rlboost', '--help']\nfrom infra.cli.app import app\ntry:\n    app()\nexcept SystemExit:\n    pass\nprint('LOADED', sorted(m for m in %r if m in sys.modules))"
        % (HEAVY,)
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert "LOADED []" in out.stdout and "Usage" in out.stdout
