"""`rlboost status --run ID`: the fleet's table (instance, pool, served version and sha, samples
held, heartbeat age) within 80 columns, read from a real Redis; bad input is one line, exit 2."""

from __future__ import annotations

import uuid

import pytest
from rich.console import Console
from typer.testing import CliRunner

from infra.cli.app import app
from infra.cli.status import fleet_table
from infra.rollout.instance import InstanceSpec
from infra.rollout.registry import InstanceRegistry, InstanceSnapshot
from infra.rollout.tokenlog import TokenLog
from rl import env_vars

GOOD, BAD = "a" * 64, "b" * 64


def _snapshot(instance_id: str, version: int | None, sha: str | None, alive: bool = True) -> InstanceSnapshot:
    spec = InstanceSpec(instance_id=instance_id, pool="gcp-us-central1-a-spot")
    return InstanceSnapshot(spec, 8, alive, 100.0, 110.0, version, 6, 2, weights_sha=sha)


def test_the_fleet_table_fits_80_columns_and_marks_wrong_weights() -> None:
    fleet = [
        _snapshot("gcp-us-central1-a-spot-host-123456", 3, GOOD),
        _snapshot("local-spot-2", 3, BAD),
        _snapshot("local-reserved-0", 0, None),
        _snapshot("local-spot-9", None, None, alive=False),
    ]
    console = Console(width=80, record=True)
    console.print(fleet_table(fleet, {3: GOOD}, now=112.5))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert f"v3 {GOOD[:10]}" in text and f"v3 {BAD[:10]} !" in text and "v0 base" in text
    assert "2.5 s" in text and "(silent)" in text
    assert "4 instances (vnone: 1, v0: 1, v3: 2); 1 serving wrong weights" in " ".join(text.split())


def test_without_a_redis_url_it_says_so(monkeypatch) -> None:
    monkeypatch.delenv(env_vars.REDIS_URL, raising=False)
    result = CliRunner().invoke(app, ["status", "--run", "r"])
    assert result.exit_code == 2 and "--redis-url" in result.output and "Traceback" not in result.output


@pytest.mark.integration
def test_status_reads_the_runs_redis(redis_url, redis_client) -> None:
    run_id = f"status-{uuid.uuid4().hex[:8]}"
    registry = InstanceRegistry(redis_client, run_id)
    TokenLog(redis_client, run_id).expect_weights(1, GOOD)
    for name, sha in (("good", GOOD), ("tampered", BAD)):
        registry.register(InstanceSpec(instance_id=name, pool="local-spot"), slots=4, ttl_s=30)
        assert registry.heartbeat(name, 1, 3, 1, 30, weights_sha=sha)
    result = CliRunner().invoke(app, ["status", "--run", run_id, "--redis-url", redis_url], terminal_width=80)
    assert result.exit_code == 0, result.output
    assert f"v1 {GOOD[:10]}" in result.output and f"v1 {BAD[:10]} !" in result.output
    assert "1 serving wrong weights" in " ".join(result.output.split())
    unknown = CliRunner().invoke(app, ["status", "--run", "no-such-run", "--redis-url", redis_url])
    assert unknown.exit_code == 2 and "no registered instance" in unknown.output
