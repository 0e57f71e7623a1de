"""`InstanceRuns.check_boots` against a real Prefect server: an instance run that a VM's boot
script set Failed, or whose engine could not start, stops the training run with its message;
other failures and other runs' failures do not."""

from __future__ import annotations

import pytest
from prefect.client.orchestration import SyncPrefectClient
from prefect.settings import PREFECT_API_URL
from prefect.states import Failed

from infra.fleet import instance_runs
from infra.fleet.instance_runs import InstanceRuns, InstanceRunSpec
from infra.providers.errors import BootFailure
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


def test_a_failed_boot_or_engine_start_stops_the_run_with_its_message(prefect_harness, tmp_path, monkeypatch):
    monkeypatch.setattr(instance_runs, "BOOT_CHECK_S", 0.0)  # look at every call
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
    for vm in ("boot-check-a", "boot-check-b", "boot-check-c"):
        runs.create(POOL, vm)
    runs.check_boots()  # all waiting: nothing to say

    with SyncPrefectClient(api_url) as client:
        client.set_flow_run_state(runs.flow_run_id("boot-check-a"), Failed(message="some worker error"), force=True)
        runs.check_boots()  # one VM's own trouble is not the pool's
        cannot = "rollout instance boot-check-b cannot start: its engine failed: DeviceError: engine.device: cuda ..."
        client.set_flow_run_state(runs.flow_run_id("boot-check-b"), Failed(message=cannot), force=True)
    with pytest.raises(BootFailure, match=r"pool 'boot-check': rollout instance boot-check-b cannot start"):
        runs.check_boots()

    with SyncPrefectClient(api_url) as client:
        client.set_flow_run_state(runs.flow_run_id("boot-check-b"), Failed(message="recovered"), force=True)
        line = (
            "rlboost boot failed on boot-check-c: no python3 on this image, and the project needs Python 3.11 or newer"
        )
        client.set_flow_run_state(runs.flow_run_id("boot-check-c"), Failed(message=line), force=True)
    with pytest.raises(BootFailure, match="rlboost boot failed on boot-check-c: no python3"):
        runs.check_boots()
