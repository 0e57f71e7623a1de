"""Ephemeral Prefect servers started at the same instant on one Prefect home that none has migrated
yet (and no migrated seed to copy: `infra.services.prefect_seed`) start one at a time
(`infra.services.prefect_api`'s start lock): every one starts, and none of their logs holds the
traceback of two SQLite migrations run at once ("duplicate column name", then "Application startup
failed": one of two trials of three servers showed it without the lock). Real servers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rl.env_vars import PREFECT_SEED_CACHE
from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.integration


def test_servers_started_at_once_on_a_fresh_home_start_one_at_a_time(tmp_path):
    home = tmp_path / "prefect-home"
    start = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        import infra.services.prefect_defaults  # as `rlboost` sets them: no telemetry, the start-up timeout
        from infra.services.prefect_api import start_guarded_ephemeral_server
        print(start_guarded_ephemeral_server(Path(sys.argv[1])), flush=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(home)
    no_seed = tmp_path / "no-seed-cache"  # a file: no migrated seed to copy (`prefect_seed`), so they migrate
    no_seed.write_text("")
    env[PREFECT_SEED_CACHE] = str(no_seed / "cache")
    logs = [tmp_path / f"server-{i}.log" for i in range(2)]
    servers = [
        subprocess.Popen(
            [sys.executable, "-c", start, str(log)], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
        )
        for log in logs
    ]
    outputs = [server.communicate(timeout=180)[0] for server in servers]
    assert [server.returncode for server in servers] == [0, 0], outputs
    assert all(output.strip().endswith("/api") for output in outputs), outputs
    for log in logs:
        text = log.read_text() if log.exists() else ""
        assert "Traceback" not in text and "Application startup failed" not in text, text[-3000:]
