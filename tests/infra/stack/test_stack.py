"""`rlboost up`, then Prefect for real through its own CLI, then `rlboost down`.

One stack for the module, started and stopped with the real `rlboost` command:

- `up` prints the API URL to export, and refuses a second stack in the same state directory;
- `prefect deployment run rl-train/grpo --watch` trains a tiny 2-step run to completion on the
  stack's worker, with rollout instances that are `rollout-instance` flow runs on their pools,
  drained (Completed) at the end;
- a preempted instance's run ends Crashed: with notice it drains and says so at once; without
  notice (SIGKILL) the heartbeat automation marks it Crashed; an undeployed pool is refused;
- `down` stops exactly the process groups `up` recorded, and nothing that talks to the stack's API
  is left running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter, FlowRunFilterTags

from infra.fleet.prefect_local import InstanceRunSpec, PrefectLocalProvider, UnknownPool
from infra.providers.pool import PoolSpec
from infra.rollout.registry import InstanceRegistry
from infra.rollout.settings import WorkerSettings
from infra.stack.stack import StackState
from rl.engine_spec import EngineSpec
from tests.helpers import REPO_ROOT, RESERVED_POOL, save_tiny_model, spot_pool, tiny_run, tiny_shape

pytestmark = pytest.mark.integration

ROOT = REPO_ROOT
BIN = Path(sys.executable).parent
ZOMBIE_AFTER_S = 45
"""The automation's window in this test (the file's default is 90 s): above the 30 s heartbeat."""
POOLS = [RESERVED_POOL, spot_pool()]


def _cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        cwd=ROOT,
        env={**os.environ, **(env or {}), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("stack")
    result = _cli("rlboost", "up", "--state-dir", str(state_dir), "--zombie-after-s", str(ZOMBIE_AFTER_S))
    assert result.returncode == 0, result.stdout + result.stderr
    state = StackState.load(state_dir)
    yield state, result.stdout
    if StackState.load(state_dir) is not None:  # a test failed before `down`
        _cli("rlboost", "down", "--state-dir", str(state_dir))


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    shape = tiny_shape()
    return save_tiny_model(tmp_path_factory.mktemp("model") / "base", shape)


def test_up_prints_the_api_url_and_refuses_a_second_stack(stack):
    state, output = stack
    assert output.strip().splitlines()[-1] == f"export PREFECT_API_URL={state.api_url}"
    assert state.deployments == [
        "rl-eval/checkpoint",
        "rl-train/grpo",
        "rl-train/grpo-nightly",
        "rollout-instance/reserved",
        "rollout-instance/spot",
    ]
    assert state.work_pools == ["reserved", "spot"] and state.workers == ["reserved/default"]
    assert [p.name for p in state.processes] == ["server", "redis", "worker-reserved-default"]
    assert all(p.leader_alive() for p in state.processes)
    with redis.Redis.from_url(state.redis_url, decode_responses=True) as client:  # the token logs survive a restart
        settings = client.config_get("append*")
        assert (settings["appendonly"], settings["appendfsync"]) == ("yes", "everysec")
    with SyncPrefectClient(state.api_url) as client:
        nightly = client.read_deployment_by_name("rl-train/grpo-nightly")
        assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
        assert (
            client.read_automations_by_name("rlboost-crash-zombie-flow-runs")[0].trigger.within.total_seconds()
            == ZOMBIE_AFTER_S
        )
        [evaluate] = client.read_automations_by_name("rlboost-eval-on-checkpoint")
        assert evaluate.trigger.expect == {"rlboost.checkpoint.saved"}
        assert evaluate.actions[0].deployment_id == client.read_deployment_by_name("rl-eval/checkpoint").id

    again = _cli("rlboost", "up", "--state-dir", str(state.state_dir))
    assert again.returncode == 1
    text = " ".join(again.stdout.split())
    assert "a stack is already up" in text and state.api_url in text and "rlboost down" in text
    assert StackState.load(state.state_dir).processes == state.processes


def test_deployment_run_trains_to_completion_with_instances_as_flow_runs(stack, base_model_dir, tmp_path):
    state, _ = stack
    overrides = tiny_run(
        base_model_dir,
        tmp_path,
        "stack-e2e",
        2,
        {
            "run.output_dir": str(tmp_path),
            "run.checkpoint_every": 1,
            "fabric.instances": "prefect",
            "fabric.pools": POOLS,
            "fabric.worker": {"slots": 8, "heartbeat_s": 0.3, "ttl_s": 3.0},
        },
    )
    result = _cli(
        "prefect",
        "deployment",
        "run",
        "rl-train/grpo",
        "--watch",
        "--params",
        json.dumps({"overrides": overrides}),
        env={"PREFECT_API_URL": state.api_url},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Flow run finished successfully in 'Completed'" in result.stdout
    assert (tmp_path / "stack-e2e" / "checkpoints" / "step_000002" / "model.safetensors").exists()

    with SyncPrefectClient(state.api_url) as client:
        [train] = client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["grpo"])))
        assert train.state.is_completed() and train.work_queue_name == "default"
        steps = {json.loads(p.read_text())["step"] for p in (tmp_path / "stack-e2e" / "steps").glob("*/metrics.json")}
        assert steps == {1, 2}
        instances = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["rollout-instance"]))
        )
        by_name = {r.name: r for r in instances}
        assert set(by_name) == {"reserved/reserved-0", "spot/spot-0"}, by_name
        for run in instances:
            assert run.state.is_completed(), (run.name, run.state)
            assert run.work_queue_name.endswith(run.name.split("/")[1])
        assert {client.read_deployment(r.deployment_id).name for r in instances} == {"reserved", "spot"}


def _state(client: SyncPrefectClient, flow_run_id):
    return client.read_flow_run(flow_run_id).state


def test_preempted_instances_end_crashed_and_unknown_pools_are_refused(stack, base_model_dir, tmp_path):
    state, _ = stack
    spec = InstanceRunSpec(
        run_id="preempt-test",
        redis_url=state.redis_url,
        model=str(base_model_dir.resolve()),
        worker=WorkerSettings(heartbeat_s=0.3, ttl_s=3.0),
        engine=EngineSpec(),
    )
    spot = PoolSpec(
        name="spot", capacity_class="spot", size=2, machine_type="a2-highgpu-1g", price_per_hour=1.1, notice_s=20.0
    )
    provider = PrefectLocalProvider(spec, api_url=state.api_url, log_dir=tmp_path / "instances")
    client = redis.Redis.from_url(state.redis_url)
    try:
        with pytest.raises(
            UnknownPool,
            match=r"unknown pool 'gpu'.*no deployment rollout-instance/gpu.*deployed rollout pools: reserved, spot",
        ):
            provider.launch(spot.model_copy(update={"name": "gpu"}), 1)
        provider.launch(spot, 2)
        registry = InstanceRegistry(client, spec.run_id)
        deadline = time.time() + 240
        while len(registry.alive()) < 2:
            assert time.time() < deadline, f"instances never registered; logs in {tmp_path / 'instances'}"
            time.sleep(0.2)
        password = urlsplit(state.redis_url).password  # in the instances' environment, never argv
        assert password not in subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
        provider.terminate("spot-0", "preempted")
        provider.terminate("spot-1", "preempted_silent")
        with SyncPrefectClient(state.api_url) as api:
            noticed, silent = provider.flow_run_id("spot-0"), provider.flow_run_id("spot-1")
            deadline = time.time() + 30
            while not _state(api, noticed).is_crashed():
                assert time.time() < deadline, _state(api, noticed)
                time.sleep(0.5)
            assert _state(api, noticed).message.startswith("preempted: SIGTERM received; instance spot-0")
            assert _state(api, silent).is_running(), "nobody reports a silently killed instance: it stays Running"
            deadline = time.time() + ZOMBIE_AFTER_S + 60
            while not _state(api, silent).is_crashed():
                assert time.time() < deadline, _state(api, silent)
                time.sleep(1)
            assert _state(api, silent).message.startswith("Its heartbeats stopped")
    finally:
        provider.shutdown()
        client.close()
    assert {r.instance_id: r.reason for r in provider.instances()} == {
        "spot-0": "preempted",
        "spot-1": "preempted_silent",
    }
    assert not [log for log in (tmp_path / "instances").iterdir() if password.encode() in log.read_bytes()]


def _processes_using(api_url: str) -> list[int]:
    """Processes whose environment points at this API (workers, flow runs, instances)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue
        if f"PREFECT_API_URL={api_url}".encode() in environ.split(b"\0"):
            found.append(int(entry))
    return [pid for pid in found if pid != os.getpid()]


def test_down_stops_exactly_what_up_started(stack):
    state, _ = stack
    result = _cli("rlboost", "down", "--state-dir", str(state.state_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stopped worker-reserved-default" in result.stdout and "is down" in result.stdout
    assert not any(p.members() for p in state.processes)
    assert StackState.load(state.state_dir) is None
    assert (state.state_dir / "prefect.db").exists(), "the run history stays for the next `rlboost up`"
    assert not _processes_using(state.api_url)
