"""CompositeProvider routing a real LocalProvider (`sleep` processes) and a GcpProvider (the fake
Compute Engine): launch and quote by pool, merged lists and preemptions, describe and terminate by
instance, start/shutdown of the local side, and pools of kinds it has no provider for."""

from __future__ import annotations

import time

import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials

from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.composite import CompositeProvider
from infra.providers.gcp import GcpProvider
from infra.providers.local import LocalProvider
from infra.providers.pool import PoolSpec
from infra.providers.prices_live import offline_price

pytestmark = pytest.mark.integration  # real processes

LOCAL = PoolSpec(name="local-spot", capacity_class="spot", size=2, machine_type="g2-standard-8", price_per_hour=0.11)
GCP = PoolSpec.model_validate(
    {
        "name": "l4-spot",
        "provider": "gcp",
        "capacity_class": "spot",
        "size": 2,
        "machine_type": "g2-standard-8",
        "price_per_hour": 0.5,
        "gcp": {
            "project": "rollout-proj",
            "zones": ["us-central1-a"],
            "image": "projects/deeplearning-platform-release/global/images/family/x",
        },
    }
)
AZURE = PoolSpec.model_validate(
    {
        "name": "t4-azure",
        "provider": "azure",
        "capacity_class": "spot",
        "size": 1,
        "machine_type": "Standard_NC4as_T4_v3",
        "price_per_hour": 0.2,
        "azure": {
            "subscription_id": "00000000-0000-0000-0000-000000000000",
            "resource_group": "rg",
            "zones": ["eastus-1"],
            "image": "microsoft-dsvm:ubuntu-hpc:2204:latest",
            "subnet_id": "/subscriptions/x/resourceGroups/rg/providers/Microsoft.Network/virtualNetworks/v/subnets/s",
            "ssh_public_key": "ssh-ed25519 AAAA test",
        },
    }
)


@pytest.fixture
def gcp(gce, clock) -> GcpProvider:
    return GcpProvider(
        run_id="mixed",
        bootstrap=WorkerBootstrap(install="image"),
        credentials=AnonymousCredentials(),
        client_options=ClientOptions(api_endpoint=gce.url),
        live_prices=False,
        clock=clock,
        sleep=lambda s: None,
    )


def local_provider(seconds: float = 60) -> LocalProvider:
    return LocalProvider(lambda pool, instance_id: ["sleep", str(seconds)])


@pytest.fixture
def local():
    provider = local_provider()
    yield provider
    provider.shutdown()


def ids(records) -> list[str]:
    return sorted(r.instance_id for r in records)


def test_routes_launch_quote_describe_and_terminate_by_pool_and_instance(local, gcp, gce):
    composite = CompositeProvider({"local": local, "gcp": gcp})
    local_ids = ids(composite.launch(LOCAL, 2))
    cloud_ids = ids(composite.launch(GCP, 2))
    assert local_ids == ["local-spot-0", "local-spot-1"] and ids(local.instances()) == local_ids
    assert ids(gcp.instances()) == cloud_ids == gce.names("us-central1-a")
    assert ids(composite.instances()) == sorted(local_ids + cloud_ids)

    assert composite.quote(LOCAL) == 0.11
    assert composite.quote(GCP) == pytest.approx(offline_price(GCP, "us-central1-a")) != 0.5
    assert composite.describe(local_ids[0]).pool == "local-spot"
    assert composite.describe(cloud_ids[0]).zone == "us-central1-a"

    composite.terminate(local_ids[0])
    composite.terminate(cloud_ids[0])
    assert local.describe(local_ids[0]).state == "terminating"
    assert gcp.describe(cloud_ids[0]).state == "terminating"
    assert gce.names(status="STOPPING") == [cloud_ids[0]]
    assert ids(composite.instances(live_only=True)) == sorted(local_ids + cloud_ids)
    deadline = time.monotonic() + 5
    while local.describe(local_ids[0]).state != "terminated" and time.monotonic() < deadline:
        local.tick()
        time.sleep(0.02)
    assert ids(composite.instances(live_only=True)) == sorted([local_ids[1], *cloud_ids])
    with pytest.raises(KeyError, match="nobody-0"):
        composite.describe("nobody-0")
    with pytest.raises(KeyError, match="nobody-0"):
        composite.terminate("nobody-0")


def test_preemptions_of_every_provider_are_merged_once(local, gcp, gce):
    composite = CompositeProvider({"local": local, "gcp": gcp})
    (local_id,) = ids(composite.launch(LOCAL, 1))
    (cloud_id,) = ids(composite.launch(GCP, 1))
    composite.terminate(local_id, "preempted")
    gce.preempt(cloud_id)
    composite.refresh([LOCAL, GCP])
    events = composite.preemptions()
    assert sorted((e.instance_id, e.pool) for e in events) == [(cloud_id, "l4-spot"), (local_id, "local-spot")]
    assert composite.preemptions() == []


def test_start_and_shutdown_reach_the_local_provider_only(gcp, gce):
    local = local_provider(seconds=0.05)
    composite = CompositeProvider({"local": local, "gcp": gcp})
    composite.launch(LOCAL, 1)
    (cloud_id,) = ids(composite.launch(GCP, 1))
    composite.start()
    # The local tick thread runs: the finished instance is reaped and replaced.
    deadline = time.monotonic() + 5
    while len(local.instances()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert local.describe("local-spot-0").reason == "finished" and len(local.instances()) >= 2
    composite.shutdown()
    assert {r.state for r in local.instances()} == {"terminated"}
    with pytest.raises(RuntimeError, match="shut down"):
        composite.launch(LOCAL, 1)
    assert gcp.describe(cloud_id).state == "running" and gce.names() == [cloud_id]


def test_a_pool_of_a_kind_without_provider_is_refused_by_name(local):
    composite = CompositeProvider({"local": local})
    for call in (
        lambda: composite.launch(GCP, 1),
        lambda: composite.quote(AZURE),
        lambda: composite.refresh([LOCAL, GCP]),
    ):
        with pytest.raises(ValueError, match=r"pool '(l4-spot|t4-azure)' has provider '(gcp|azure)'.*it has: local"):
            call()
    assert local.instances() == []
    with pytest.raises(ValueError, match=r"no such provider kind: \['aws'\]"):
        CompositeProvider({"local": local, "aws": local})
