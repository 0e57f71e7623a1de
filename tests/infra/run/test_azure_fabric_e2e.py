"""rl-train with an Azure Spot pool, end to end against a fake Resource Manager whose VMs really boot.

The training run (a real Prefect server, the flow in this process) keeps an `azure` pool of 2 Spot
VMs through `azure-mgmt-compute` against `tests.fakes.arm`, with a bearer token the fake checks on
every request. Every VM the fake creates boots here (`tests.fakes.azure_vm_host`) from its custom
data: the boot script fetches the run's wheel and lock from the weight store, verifies them,
installs the wheel into the image's venv, and runs the Azure Scheduled Events watcher around a
Prefect worker on the VM's own work queue, which runs the VM's `rollout-instance` flow run. After
step 1 Azure evicts both VMs through Scheduled Events (`Preempt`): their watchers drain the
workers and approve the events, their flow runs end Crashed, the capacity manager starts
replacements, and step 2 finishes on them. At the end the VMs drain (runs Completed) and are
deleted, and the ledger has every VM's life, eviction and cost.

(The only wiring a real run does not have: the provider gets the static test credential, and the
SDK's bearer policy is allowed over the fake's plain http.)
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.settings import PREFECT_API_URL

from flows.rl_train import rl_train
from infra.ledger.recorder import Ledger
from infra.run import fabric as fabric_module
from infra.services.redis_embedded import EmbeddedRedis
from rl.rollout import read_samples
from tests.fakes.arm import FakeArm
from tests.fakes.azure_vm_host import FakeAzureVmHost
from tests.fakes.support import serving
from tests.fakes.vm_host import bake_image_venv
from tests.helpers import cloud_fabric_run, save_tiny_model, tiny_run, tiny_shape
from tests.infra.providers.test_azure import SUBNET, BearerOverHttp, StaticCredential
from tests.infra.run.test_cloud_fabric_e2e import deploy_rollout_instance, routable_ipv4

pytestmark = pytest.mark.integration

POOL = "t4-spot"
STEPS = 4
TOKEN = "eyJ0eXAiOiJKV1QiLCJhbGciOi.fake.arm"
ARM_SCOPE = "https://management.azure.com/.default"


def test_training_keeps_an_azure_spot_pool_through_an_eviction(prefect_harness, tmp_path, monkeypatch):
    address = routable_ipv4()
    if address is None:
        pytest.skip("this machine has no routable IPv4 address for the VMs to reach Redis at")
    api_url = PREFECT_API_URL.value()
    base = tmp_path / "base"
    save_tiny_model(base, tiny_shape())
    install_dir = tmp_path / "opt"
    install_dir.mkdir()
    venv = bake_image_venv(install_dir)
    monkeypatch.setenv("RLBOOST_WHEEL_CACHE", str(tmp_path / "wheels"))
    deploy_rollout_instance(api_url, install_dir, POOL)

    credential = StaticCredential(TOKEN)
    real_options = fabric_module.cloud_options

    def options_with_test_credential(cloud):
        options = real_options(cloud)
        options["azure"] |= {"credential": credential, "authentication_policy": BearerOverHttp(credential, ARM_SCOPE)}
        return options

    monkeypatch.setattr(fabric_module, "cloud_options", options_with_test_credential)

    with (
        EmbeddedRedis(host=address) as redis_server,
        serving(FakeArm(clock=time.time, token=TOKEN, operation_polls=1)) as arm,
    ):
        vm_env = {
            "PATH": os.environ["PATH"],
            "DO_NOT_TRACK": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "OMP_NUM_THREADS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",
        }
        pool = {
            "name": POOL,
            "provider": "azure",
            "capacity_class": "spot",
            "size": 2,
            "min_size": 2,
            "machine_type": "Standard_NC4as_T4_v3",
            "device": "cpu",  # the "VMs" are processes on this CPU-only machine; an NC VM would get cuda
            "price_per_hour": 0.2,
            "notice_s": 30.0,
            "azure": {
                "subscription_id": arm.subscription,
                "resource_group": "rollout-rg",
                "zones": ["eastus-1", "eastus-2"],
                "image": "microsoft-dsvm:ubuntu-hpc:2204:latest",
                "subnet_id": SUBNET,
                "ssh_public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample rollout",
            },
        }
        overrides = tiny_run(
            base,
            tmp_path,
            "azure-e2e",
            STEPS,
            cloud_fabric_run(pool, redis_server.url, install_dir, azure_base_url=arm.url),
        )
        run_dir = tmp_path / "runs" / "azure-e2e"
        with FakeAzureVmHost(arm, tmp_path / "vms", vm_env, grace_s=20.0, notice_s=30.0) as host:
            evicted: list[str] = []

            def evict_after_step_1() -> None:
                deadline = time.monotonic() + 600
                while not (run_dir / "steps" / "000001" / "metrics.json").exists():
                    if time.monotonic() > deadline:
                        return
                    time.sleep(0.1)
                # The location reclaims both at once: neither is gone before both are drained, so the
                # capacity manager sees both go before a replacement could carry the run to its end.
                evicted.extend(sorted(host.running()))
                host.reclaim_together(evicted)

            evicter = threading.Thread(target=evict_after_step_1, daemon=True)
            evicter.start()
            state = rl_train(overrides=overrides, return_state=True)
            evicter.join(timeout=5)
            logs = {name: vm.log.read_text(errors="replace")[-3000:] for name, vm in host.booted.items()}
            assert state.is_completed(), f"{state}\n" + "\n".join(f"--- {n}\n{t}" for n, t in logs.items())
            deadline = time.monotonic() + 120  # the VMs drain and are deleted after the run returns
            while set(host.booted) - host.gone and time.monotonic() < deadline:
                time.sleep(0.2)

        for step in range(1, STEPS + 1):
            metrics = json.loads((run_dir / "steps" / f"{step:06d}" / "metrics.json").read_text())
            ids = [s.sample_id for s in read_samples(run_dir / "steps" / f"{step:06d}" / "rollout.jsonl")]
            assert metrics["groups_dropped"] == 0 and len(ids) == len(set(ids)) == 16, metrics

        # Both VMs were evicted through Scheduled Events and approved their events once drained.
        assert len(evicted) == 2
        for name in evicted:
            vm = host.booted[name]
            assert [event for event, _ in vm.imds.approvals] == [vm.event_id], f"{name}: {logs[name]}"
            assert not vm.imds.violations, vm.imds.violations
        assert len(host.booted) == 4, f"expected 2 VMs and 2 replacements, booted {sorted(host.booted)}"
        assert arm.vms == {} and host.gone == set(host.booted)
        assert not arm.violations, arm.violations
        assert (venv / ".rlboost-wheel-sha256").exists(), "the VMs installed the run's wheel"

        with SyncPrefectClient(api_url) as client:
            # A drained VM's flow run reports its final state a moment after the VM is gone.
            deadline = time.monotonic() + 120
            while True:
                runs = {
                    r.name: r
                    for r in client.read_flow_runs(
                        deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[POOL]))
                    )
                }
                if all(r.state.is_final() for r in runs.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert set(runs) == {f"{POOL}/{name}" for name in host.booted}, sorted(runs)
            states = {name.split("/", 1)[1]: run.state for name, run in runs.items()}
            assert all(
                states[n].is_crashed()
                and ("preempted: SIGTERM" in states[n].message or "termination signal" in states[n].message)
                for n in evicted
            ), states
            assert all(s.is_completed() for n, s in states.items() if n not in evicted), states

        ledger_run_id = state.result()["ledger_run_id"]
        with Ledger() as ledger:
            report = ledger.report(ledger_run_id)
        by_id = {i.instance_id: i for i in report.instances}
        assert set(by_id) == set(host.booted)
        assert all(by_id[n].reason == "preempted" for n in evicted)
        assert all(i.pool == POOL and i.capacity_class == "spot" and i.spend_usd > 0 for i in by_id.values())
        assert report.preemptions == 2 and report.tokens_generated > 0
