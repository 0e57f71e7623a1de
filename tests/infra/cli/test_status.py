"""`rlboost status --run NAME`: the fleet's table (instance, pool, served version and sha, samples
held, heartbeat age) within 80 columns, read from a real Redis (named, or the one the running run
started, found through its directory); bad input is one line, exit 2."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from infra.cli.app import app
from infra.cli.status import fleet_table, run_and_redis
from infra.rollout.instance import InstanceSpec
from infra.rollout.registry import InstanceRegistry, InstanceSnapshot
from infra.rollout.tokenlog import TokenLog
from infra.run.identity import claim_identity
from infra.run.redis_address import write_redis_url
from infra.services.ports import free_port
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


def _run_dir(runs: Path, name: str) -> tuple[Path, str]:
    directory = runs / name
    directory.mkdir(parents=True)
    return directory, claim_identity(directory, name).run_id


def test_the_run_is_found_by_name_or_id_with_its_embedded_redis(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(env_vars.REDIS_URL, raising=False)
    directory, run_id = _run_dir(tmp_path, "grpo-demo")
    write_redis_url(directory, "redis://:secret@127.0.0.1:6399/0")
    address = directory / "redis.url"
    assert run_and_redis("grpo-demo", None, tmp_path) == (run_id, "redis://:secret@127.0.0.1:6399/0", address)
    assert run_and_redis(run_id, None, tmp_path) == (run_id, "redis://:secret@127.0.0.1:6399/0", address)
    assert run_and_redis("grpo-demo", "redis://other:1/0", tmp_path) == (run_id, "redis://other:1/0", None)
    assert run_and_redis("elsewhere-1a2b", "redis://other:1/0", tmp_path) == (
        "elsewhere-1a2b",
        "redis://other:1/0",
        None,
    )


def test_a_run_whose_driver_was_killed_is_not_running(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(env_vars.REDIS_URL, raising=False)
    directory, _ = _run_dir(tmp_path, "killed")
    write_redis_url(directory, f"redis://:secret@127.0.0.1:{free_port()}/0")  # left behind: nothing answers there
    result = CliRunner().invoke(app, ["status", "--run", "killed", "--runs-dir", str(tmp_path)])
    assert result.exit_code == 2 and "Traceback" not in result.output and "secret" not in result.output
    assert "run 'killed' is not running: its embedded Redis (" in " ".join(result.output.split())


def test_without_a_redis_to_read_it_says_so(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(env_vars.REDIS_URL, raising=False)
    _run_dir(tmp_path, "on-its-own-redis")  # a run on a Redis of the user's: no redis.url
    stopped = CliRunner().invoke(app, ["status", "--run", "on-its-own-redis", "--runs-dir", str(tmp_path)])
    assert stopped.exit_code == 2 and "Traceback" not in stopped.output
    assert "has no embedded Redis running (no " in stopped.output and "--redis-url" in stopped.output
    unknown = CliRunner().invoke(app, ["status", "--run", "r", "--runs-dir", str(tmp_path)])
    assert unknown.exit_code == 2 and "the runs there are on-its-own-redis" in unknown.output
    assert "--redis-url" in unknown.output


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


@pytest.mark.integration
def test_status_finds_a_running_runs_embedded_redis_by_its_name(redis_url, redis_client, tmp_path) -> None:
    directory, run_id = _run_dir(tmp_path, "demo")
    write_redis_url(directory, redis_url)  # as the fabric does when it starts the run's own Redis
    registry = InstanceRegistry(redis_client, run_id)
    registry.register(InstanceSpec(instance_id="spot-0", pool="local-spot"), slots=4, ttl_s=30)
    assert registry.heartbeat("spot-0", 0, 2, 0, 30)
    result = CliRunner(env={env_vars.REDIS_URL: None}).invoke(
        app, ["status", "--run", "demo", "--runs-dir", str(tmp_path)], terminal_width=80
    )
    assert result.exit_code == 0, result.output
    assert "spot-0" in result.output and "local-spot" in result.output
