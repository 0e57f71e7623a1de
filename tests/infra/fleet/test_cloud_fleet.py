"""CloudFleet: its background capacity manager keeps a GCP pool at target against the fake Compute
Engine through a preemption and deletes the VMs when stopped; a configuration error ends the loop
and is kept; a run without cloud pools holds nothing; a loopback Redis and a missing extra are refused."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials

from infra.fleet.cloud_fleet import CloudFleet
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.errors import CloudError, PoolConfigError
from infra.providers.gcp import GcpProvider
from infra.providers.interface import InstanceRecord
from infra.providers.pool import PoolSpec
from infra.run.fabric_config import CloudSettings
from tests.fakes.gce import FakeGce
from tests.helpers import Clock, wait_for

REDIS = "redis://:secret@redis.internal:6379/0"
LOCAL = PoolSpec(name="local", capacity_class="reserved", size=1, machine_type="g2-standard-8", price_per_hour=0.0)
RECONCILE_S = CloudSettings().reconcile_s
"""The run's default (`fabric.cloud.reconcile_s`)."""


def gcp_pool(project: str = "rollout-proj") -> PoolSpec:
    return PoolSpec.model_validate(
        {
            "name": "l4-spot",
            "provider": "gcp",
            "capacity_class": "spot",
            "size": 2,
            "min_size": 2,
            "machine_type": "g2-standard-8",
            "price_per_hour": 0.5,
            "gcp": {
                "project": project,
                "zones": ["us-central1-a", "us-central1-b"],
                "image": "projects/deeplearning-platform-release/global/images/family/x",
            },
        }
    )


def fleet_for(pools, gce: FakeGce, clock: Clock, **kwargs) -> CloudFleet:
    options = {
        "gcp": {
            "credentials": AnonymousCredentials(),
            "client_options": ClientOptions(api_endpoint=gce.url),
            "live_prices": False,
            "sleep": lambda s: None,
        }
    }
    return CloudFleet(
        pools,
        run_id="fleet-run",
        redis_url=REDIS,
        bootstrap=WorkerBootstrap(install="image"),
        interval_s=0.02,
        clock=clock,
        options=options,
        **kwargs,
    )


def test_keeps_a_gcp_pool_at_target_through_a_preemption_then_deletes_its_vms(gce, clock):
    changes: list[InstanceRecord] = []
    fleet = fleet_for([LOCAL, gcp_pool()], gce, clock, on_change=changes.append)
    assert fleet.pools == (gcp_pool(),) and list(fleet.providers) == ["gcp"]
    gcp = fleet.providers["gcp"]
    assert isinstance(gcp, GcpProvider) and gcp.run_id == "fleet-run"
    fleet.start()
    try:
        wait_for(lambda: len(gce.names()) == 2 and len(gcp.instances()) == 2)
        first = gce.names()
        gce.preempt(first[0])
        wait_for(lambda: gcp.describe(first[0]).reason == "preempted" and len(gce.names()) == 2)
        (replacement,) = set(gce.names()) - set(first)
        gce.settle()
        wait_for(lambda: gcp.describe(first[0]).state == "terminated")
    finally:
        fleet.stop()
    assert fleet.failure is None and "cloud-fleet" not in [t.name for t in threading.enumerate()]
    # Stopping deleted the two VMs that were running; the preempted one was already gone.
    assert gce.names() == [] and gce.names(status="STOPPING") == sorted([first[1], replacement])
    assert {r.instance_id: r.reason for r in gcp.instances(live_only=True)} == dict.fromkeys(
        [first[1], replacement], "scaled_down"
    )
    assert [(c.state, c.reason) for c in changes if c.instance_id == first[0]] == [
        ("running", None),
        ("terminating", "preempted"),
        ("terminated", "preempted"),
    ]
    assert {c.instance_id for c in changes} == {first[0], first[1], replacement}
    inserts = len(gce.requests_to("POST", r"/instances$"))
    time.sleep(0.1)
    assert len(gce.requests_to("POST", r"/instances$")) == inserts  # nothing reconciles any more


def test_a_configuration_error_ends_the_loop_and_is_kept(gce, clock):
    fleet = fleet_for([gcp_pool(project="missing-proj")], gce, clock)
    fleet.start()
    wait_for(lambda: fleet.failure is not None)
    assert isinstance(fleet.failure, PoolConfigError) and "missing-proj" in str(fleet.failure)
    fleet.stop()
    assert gce.requests_to("POST", r"/instances$") == []


def test_without_cloud_pools_there_is_nothing_to_run():
    fleet = CloudFleet(
        [LOCAL],
        run_id="r",
        redis_url="redis://127.0.0.1:6379/0",
        bootstrap=WorkerBootstrap(install="image"),
        interval_s=RECONCILE_S,
    )
    assert fleet.pools == () and fleet.providers == {}
    fleet.start()
    fleet.stop()
    assert fleet.failure is None


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pw@127.0.0.1:40123/0",
        "redis://localhost",
        "redis://[::1]:6379",
        "unix:///tmp/redis.sock",
    ],
)
def test_a_loopback_redis_is_refused(url):
    with pytest.raises(CloudError, match=r"pool 'l4-spot': .*gcp VMs cannot reach.*set fabric.redis_url") as caught:
        CloudFleet(
            [gcp_pool()], run_id="r", redis_url=url, bootstrap=WorkerBootstrap(install="image"), interval_s=RECONCILE_S
        )
    assert "pw" not in str(caught.value)


def test_a_missing_extra_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.delitem(sys.modules, "infra.providers.gcp")
    monkeypatch.setitem(sys.modules, "google.cloud", None)
    with pytest.raises(CloudError, match=r"pool 'l4-spot': .*`gcp` extra.*google\.cloud.*pip install 'rlboost\[gcp\]'"):
        CloudFleet(
            [LOCAL, gcp_pool()],
            run_id="r",
            redis_url=REDIS,
            bootstrap=WorkerBootstrap(install="image"),
            interval_s=RECONCILE_S,
        )
