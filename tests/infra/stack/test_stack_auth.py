"""`rlboost up --host 0.0.0.0`: a real Prefect server on every interface that requires basic auth.
The credential is generated into a 0600 file and never printed; an unauthenticated request is
refused and an authenticated one works; the stack's own clients (work pools, `prefect deploy`, the
worker) used it, since the stack came up; `down` stops it."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from infra.services.ports import free_port
from infra.stack.stack import StackState
from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RLBOOST = str(Path(sys.executable).parent / "rlboost")


def _rlboost(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("PREFECT_API_AUTH_STRING", None)
    return subprocess.run([RLBOOST, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_a_stack_on_every_interface_requires_the_generated_credential(tmp_path):
    port = str(free_port("0.0.0.0"))  # (not 4200: another test's stack may be starting there)
    up = _rlboost("up", "--host", "0.0.0.0", "--port", port, "--state-dir", str(tmp_path), "--redis-appendfsync", "off")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = StackState.load(tmp_path)
        assert state.auth_file == tmp_path.resolve() / "prefect-auth"
        assert state.auth_file.stat().st_mode & 0o777 == 0o600
        credential = state.auth_file.read_text().strip()
        user, password = credential.split(":", 1)
        assert user == "rlboost" and len(password) >= 32
        assert password not in up.stdout + up.stderr  # told where it is, never shown
        assert f'export PREFECT_API_AUTH_STRING="$(cat {state.auth_file})"' in up.stdout
        assert state.deployments and state.workers  # its own clients authenticated

        flows = f"{state.api_url}/flows/filter"
        assert httpx.post(flows, json={}, timeout=10).status_code == 401
        wrong = base64.b64encode(b"rlboost:not-the-password").decode()
        assert httpx.post(flows, json={}, headers={"Authorization": f"Basic {wrong}"}, timeout=10).status_code == 401
        right = base64.b64encode(credential.encode()).decode()
        answer = httpx.post(flows, json={}, headers={"Authorization": f"Basic {right}"}, timeout=10)
        assert answer.status_code == 200 and {f["name"] for f in answer.json()} >= {"rl-train"}
    finally:
        down = _rlboost("down", "--state-dir", str(tmp_path))
    assert down.returncode == 0, down.stdout + down.stderr


def test_the_credential_is_kept_across_ups_and_refused_when_others_may_read_it(tmp_path):
    from infra.stack.stack import StackError, prefect_auth_file

    first = prefect_auth_file(tmp_path)
    assert prefect_auth_file(tmp_path).read_text() == first.read_text()
    first.chmod(0o644)
    with pytest.raises(StackError, match=r"chmod 600 .*prefect-auth"):
        prefect_auth_file(tmp_path)
