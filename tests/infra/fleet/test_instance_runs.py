"""`InstanceRuns.worker_ends` and `run_message` against a real Prefect server: how the runs of live
instances ended (a VM's boot script or a worker that cannot start set its run Failed; a drain
completes it), what the instance watch turns into a replaced instance; runs still waiting or
running, and other runs, say nothing."""

from __future__ import annotations

import pytest
from prefect.client.orchestration import SyncPrefectClient
from prefect.settings import PREFECT_API_URL
from prefect.states import Completed, Failed, Running

from infra.fleet.instance_runs import InstanceRuns, InstanceRunSpec
from infra.providers.pool import PoolSpec
from infra.rollout.settings import WorkerSettings
from rl.engine_spec import EngineSpec
from tests.infra.run.test_cloud_fabric_e2e import deploy_rollout_instance

pytestmark = pytest.mark.integration

POOL = PoolSpec.model_validate(
    {
        "name": "boot-check",
        "provider": "gcp",
        "capacity_class": "spot",
        "size": 4,
        "machine_type": "g2-standard-8",
        "price_per_hour": 0.3,
        "gcp": {"project": "rollout-proj", "zones": ["us-central1-a"], "image": "img"},
    }
)


def test_the_ends_of_live_instances_runs_with_their_messages(prefect_harness, tmp_path):
    api_url = PREFECT_API_URL.value()
    deploy_rollout_instance(api_url, tmp_path, POOL.name)
    spec = InstanceRunSpec(
        run_id="boots",
        redis_url="redis://10.0.0.5:6379/0",
        model="gs://b/m",
        worker=WorkerSettings(),
        engine=EngineSpec(),
    )
    runs = InstanceRuns(spec, api_url)
    vms = ["boot-check-a", "boot-check-b", "boot-check-c", "boot-check-d"]
    for vm in vms:
        runs.create(POOL, vm)
    assert runs.worker_ends(vms) == {}  # all waiting: nothing to say
    assert runs.run_message("boot-check-a") == ""

    line = "rlboost boot failed on boot-check-a: no python3 on this image, and the project needs Python 3.11 or newer"
    cannot = "rollout instance boot-check-b cannot start: its engine failed: DeviceError: engine.device: cuda ..."
    with SyncPrefectClient(api_url) as client:
        client.set_flow_run_state(runs.flow_run_id("boot-check-a"), Failed(message=line), force=True)
        client.set_flow_run_state(runs.flow_run_id("boot-check-b"), Failed(message=cannot), force=True)
        client.set_flow_run_state(runs.flow_run_id("boot-check-c"), Completed(message="drained"), force=True)
        client.set_flow_run_state(runs.flow_run_id("boot-check-d"), Running(), force=True)
    ends = runs.worker_ends(vms)
    assert {vm: (end.state, end.message) for vm, end in ends.items()} == {
        "boot-check-a": ("FAILED", line),
        "boot-check-b": ("FAILED", cannot),
        "boot-check-c": ("COMPLETED", "drained"),
    }
    assert all(end.at > 1.7e9 for end in ends.values())  # epoch seconds of the final state
    assert set(runs.worker_ends(["boot-check-b", "boot-check-d", "not-an-instance"])) == {"boot-check-b"}
    assert runs.run_message("boot-check-b") == cannot
    assert runs.run_message("boot-check-d") == ""  # still running
    assert runs.run_message("not-an-instance") == ""
