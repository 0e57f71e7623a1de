"""AzureProvider through the real azure-mgmt-compute SDK against the local fake Resource Manager
(`tests/fakes/arm.py`), and its Retail Prices lookups against `tests/fakes/prices.py`."""

from __future__ import annotations

import base64
import logging

import pytest
from azure.core.credentials import AccessToken
from azure.core.exceptions import ClientAuthenticationError
from azure.core.pipeline.policies import BearerTokenCredentialPolicy, SansIOHTTPPolicy

from infra.pricing import price
from infra.providers.azure import AzureProvider
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.errors import CredentialsError, PoolConfigError
from infra.providers.pool import PoolSpec
from infra.providers.prices_live import AzureRetailPrices, azure_hourly_price
from infra.providers.zonal import LABEL_POOL, LABEL_RUN, LABEL_STEP, OperationPolling
from infra.services.ports import free_port
from tests.fakes.arm import FakeArm
from tests.fakes.prices import FakeRetailPrices, azure_item
from tests.fakes.support import serving
from tests.helpers import Clock

SUBSCRIPTION = "00000000-0000-4000-8000-000000000001"
SUBNET = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/net-rg/providers/Microsoft.Network/virtualNetworks/vnet/subnets/rollout"


def azure_pool(**overrides: object) -> PoolSpec:
    azure = {
        "subscription_id": SUBSCRIPTION,
        "resource_group": "rollout-rg",
        "zones": ["eastus-1", "eastus-2"],
        "image": "microsoft-dsvm:ubuntu-hpc:2204:latest",
        "subnet_id": SUBNET,
        "ssh_public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample rollout",
    }
    azure |= overrides.pop("azure", {})  # type: ignore[arg-type]
    fields = {
        "name": "t4-spot",
        "provider": "azure",
        "capacity_class": "spot",
        "size": 4,
        "machine_type": "Standard_NC4as_T4_v3",
        "price_per_hour": 0.1,
        "max_price_per_hour": 0.3,
        "azure": azure,
    }
    return PoolSpec.model_validate(fields | overrides)


class StaticCredential:
    """A token credential that hands out a fixed token (or fails like an expired login)."""

    def __init__(self, token: str | None) -> None:
        self.token = token

    def get_token(self, *scopes: str, **kwargs: object) -> AccessToken:
        if self.token is None:
            raise ClientAuthenticationError("AzureCliCredential: Please run 'az login' to set up an account")
        return AccessToken(self.token, 2**31)


class BearerOverHttp(BearerTokenCredentialPolicy):
    """The SDK's bearer-token policy, allowed over the fake's plain http (the SDK refuses by default)."""

    def on_request(self, request):
        request.context.options["enforce_https"] = False
        return super().on_request(request)


@pytest.fixture
def arm(clock):
    with serving(FakeArm(clock=clock)) as fake:
        yield fake


@pytest.fixture
def retail():
    with serving(FakeRetailPrices()) as fake:
        yield fake


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}/api/retail/prices"


def make_provider(arm: FakeArm, clock: Clock, *, prices_url: str | None = None, **kwargs: object) -> AzureProvider:
    defaults: dict[str, object] = {
        "run_id": "run-42",
        "bootstrap": WorkerBootstrap(install="image"),
        "credential": StaticCredential("unused"),
        "base_url": arm.url,
        "authentication_policy": SansIOHTTPPolicy(),
        "retail_prices": AzureRetailPrices(prices_url or closed_port_url(), timeout_s=5),
        "live_prices": prices_url is not None,
        "polling": OperationPolling(interval_s=0.0, timeout_s=10.0, request_timeout_s=10.0),
        "clock": clock,
    }
    return AzureProvider(**(defaults | kwargs))  # type: ignore[arg-type]


def put_bodies(arm: FakeArm) -> list[dict]:
    return [r.body for r in arm.requests_to("PUT", r"/virtualMachines/")]


def test_spot_launch_asks_for_a_spot_vm_with_max_price_tags_and_the_worker(arm, clock):
    provider = make_provider(arm, clock, current_step=lambda: 5)
    handles = provider.launch(azure_pool(), 2)
    assert len(handles) == 2
    body = put_bodies(arm)[0]
    props = body["properties"]
    assert (props["priority"], props["evictionPolicy"], props["billingProfile"]) == (
        "Spot",
        "Delete",
        {"maxPrice": 0.3},
    )
    assert (body["location"], body["zones"]) == ("eastus", ["1"])
    assert body["tags"] == {LABEL_RUN: "run-42", LABEL_POOL: "t4-spot", LABEL_STEP: "5"}
    assert props["hardwareProfile"] == {"vmSize": "Standard_NC4as_T4_v3"}
    assert props["storageProfile"]["imageReference"] == {
        "publisher": "microsoft-dsvm",
        "offer": "ubuntu-hpc",
        "sku": "2204",
        "version": "latest",
    }
    assert props["osProfile"]["linuxConfiguration"]["disablePasswordAuthentication"] is True
    nic = props["networkProfile"]["networkInterfaceConfigurations"][0]
    assert nic["properties"]["ipConfigurations"][0]["properties"]["subnet"] == {"id": SUBNET}
    script = base64.b64decode(props["osProfile"]["customData"]).decode()
    name = body["properties"]["osProfile"]["computerName"]
    assert f"-m infra.watchers azure --instance {name}" in script
    assert (
        f"-m infra.services.prefect_worker --pool t4-spot --work-queue run-42-{name} --name {name} --limit 1 --run-once"
        in script
    )
    # The SDK's poller followed the Azure-AsyncOperation documents to the end.
    assert len(arm.requests_to("GET", r"/operations/")) >= 2 * arm.operation_polls
    assert sorted(arm.names()) == sorted(h.instance_id for h in handles)
    assert {r.zone for r in provider.instances()} == {"eastus-1"}
    assert len(arm.api_versions) == 1


def test_vms_run_as_the_pools_managed_identity_which_reads_the_store(arm, clock):
    identity = (
        f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rollout-rg/providers/Microsoft.ManagedIdentity/"
        "userAssignedIdentities/rollout-reader"
    )
    make_provider(arm, clock).launch(azure_pool(azure={"identity": identity}), 1)
    assert put_bodies(arm)[0]["identity"] == {"type": "UserAssigned", "userAssignedIdentities": {identity: {}}}
    assert not arm.violations
    make_provider(arm, clock, run_id="no-identity").launch(azure_pool(), 1)
    assert "identity" not in put_bodies(arm)[1]


def test_no_price_cap_bids_up_to_the_pay_as_you_go_price_and_regular_vms_bid_nothing(arm, clock):
    provider = make_provider(arm, clock)
    provider.launch(azure_pool(max_price_per_hour=None), 1)
    provider.launch(azure_pool(name="regular", capacity_class="ondemand", azure={"zones": ["westus2"]}), 1)
    spot, regular = put_bodies(arm)
    assert spot["properties"]["billingProfile"] == {"maxPrice": -1}
    assert not {"priority", "evictionPolicy", "billingProfile"} & set(regular["properties"])
    assert regular["location"] == "westus2" and "zones" not in regular


def test_allocation_failure_deletes_the_failed_vm_and_fails_over(arm, clock):
    provider = make_provider(arm, clock)
    arm.exhaust("eastus-1")
    (handle,) = provider.launch(azure_pool(), 1)
    assert provider.describe(handle.instance_id).zone == "eastus-2"
    failed_name = put_bodies(arm)[0]["properties"]["osProfile"]["computerName"]
    assert arm.requests_to("DELETE", rf"/virtualMachines/{failed_name}$"), "the Failed VM must be deleted"
    assert [b["zones"] for b in put_bodies(arm)] == [["1"], ["2"]]


def test_quota_blocks_the_whole_region(arm, clock):
    provider = make_provider(arm, clock)
    arm.exceed_quota("eastus")
    pool = azure_pool(azure={"zones": ["eastus-1", "eastus-2", "westus2"]})
    (handle,) = provider.launch(pool, 1)
    assert provider.describe(handle.instance_id).zone == "westus2"
    assert [b["location"] for b in put_bodies(arm)] == ["eastus", "westus2"]


def test_eviction_is_detected_and_the_record_ends_when_the_vm_is_gone(arm, clock):
    changes = []
    provider = make_provider(arm, clock, on_change=changes.append)
    pool = azure_pool()
    handles = provider.launch(pool, 3)  # three VMs: the list comes back in two pages
    evicted = handles[1].instance_id
    arm.evict(evicted)
    clock.advance(10)
    provider.refresh()
    record = provider.describe(evicted)
    assert (record.state, record.reason, record.notice_at) == ("terminating", "preempted", clock.t)
    (event,) = provider.preemptions()
    assert (event.instance_id, event.kill_at) == (evicted, clock.t + pool.notice_s)
    arm.settle()
    provider.refresh()
    assert provider.describe(evicted).state == "terminated"
    assert [r.state for r in provider.instances(live_only=True)] == ["running", "running"]
    assert [(c.instance_id, c.state) for c in changes if c.instance_id == evicted] == [
        (evicted, "running"),
        (evicted, "terminating"),
        (evicted, "terminated"),
    ]


def test_terminate_deletes_the_vm(arm, clock):
    provider = make_provider(arm, clock)
    (handle,) = provider.launch(azure_pool(), 1)
    provider.terminate(handle.instance_id)
    assert arm.requests_to("DELETE", rf"/virtualMachines/{handle.instance_id}$")
    arm.settle()
    provider.refresh()
    record = provider.describe(handle.instance_id)
    assert (record.state, record.reason) == ("terminated", "scaled_down")
    assert provider.preemptions() == []


def test_a_new_controller_adopts_the_runs_vms(arm, clock):
    pool = azure_pool()
    launched = {h.instance_id for h in make_provider(arm, clock, current_step=lambda: 2).launch(pool, 3)}
    make_provider(arm, clock, run_id="other-run").launch(pool, 1)
    second = make_provider(arm, clock)
    second.refresh([pool])
    assert {r.instance_id for r in second.instances()} == launched
    assert {r.launch_step for r in second.instances()} == {2}


def test_live_spot_price_comes_from_the_retail_prices_api(arm, clock, retail):
    retail.items = [
        azure_item("NC4as T4 v3", "Virtual Machines NCasT4_v3 Series", "eastus", "Standard_NC4as_T4_v3", 0.526),
        azure_item(
            "NC4as T4 v3 Spot", "Virtual Machines NCasT4_v3 Series Windows", "eastus", "Standard_NC4as_T4_v3", 0.09
        ),
        azure_item(
            "NC4as T4 v3 Low Priority", "Virtual Machines NCasT4_v3 Series", "eastus", "Standard_NC4as_T4_v3", 0.105
        ),
        azure_item(
            "NC4as T4 v3 Spot",
            "Virtual Machines NCasT4_v3 Series",
            "eastus",
            "Standard_NC4as_T4_v3",
            0.0526,
            "2024-01-01T00:00:00Z",
        ),
        azure_item("NC4as T4 v3 Spot", "Virtual Machines NCasT4_v3 Series", "eastus", "Standard_NC4as_T4_v3", 0.0631),
        azure_item("NC4as T4 v3 Spot", "Virtual Machines NCasT4_v3 Series", "westus2", "Standard_NC4as_T4_v3", 0.07),
    ]
    provider = make_provider(arm, clock, prices_url=retail.prices_url)
    assert provider.quote(azure_pool()) == pytest.approx(0.0631)  # Linux, spot, the latest meter
    assert len(retail.requests) == 3  # five eastus items, two per page
    assert provider.quote(azure_pool(name="regular", capacity_class="ondemand")) == pytest.approx(0.526)
    sent = retail.requests[0].query["$filter"]
    assert sent == (
        "serviceName eq 'Virtual Machines' and armRegionName eq 'eastus' "
        "and armSkuName eq 'Standard_NC4as_T4_v3' and priceType eq 'Consumption'"
    )


def test_quote_falls_back_offline_when_the_prices_api_is_unreachable(arm, clock, caplog):
    provider = make_provider(arm, clock, prices_url=closed_port_url())
    with caplog.at_level(logging.WARNING):
        assert provider.quote(azure_pool()) == pytest.approx(price("azure", "Standard_NC4as_T4_v3", "eastus-1", "spot"))
    assert "no live price" in caplog.text
    unlisted = azure_pool(name="d4", machine_type="Standard_D4s_v5")
    assert provider.quote(unlisted) == unlisted.price_per_hour


def test_a_meterless_answer_has_no_price():
    with pytest.raises(LookupError):
        azure_hourly_price(
            [azure_item("NC4as T4 v3", "Virtual Machines NCasT4_v3 Series Windows", "eastus", "x", 1.0)], spot=False
        )


def test_unknown_vm_size_is_a_pool_error_naming_the_fix(arm, clock):
    with pytest.raises(PoolConfigError) as info:
        make_provider(arm, clock).launch(azure_pool(machine_type="Standard_Bogus_v9"), 1)
    message = str(info.value)
    assert "pool 't4-spot'" in message and "Standard_Bogus_v9" in message and "set machine_type" in message


def test_missing_resource_group_is_a_pool_error_naming_the_fix(arm, clock):
    with pytest.raises(PoolConfigError) as info:
        make_provider(arm, clock).launch(azure_pool(azure={"resource_group": "gone-rg"}), 1)
    assert "ResourceGroupNotFound" in str(info.value) and "az group create" in str(info.value)


def test_expired_token_and_failed_login_are_clear_errors_without_secrets(arm, clock, caplog):
    arm.token = "eyJ.fresh-token"
    pool = azure_pool()
    scope = "https://management.azure.com/.default"
    with caplog.at_level(logging.DEBUG):
        stale = StaticCredential("eyJ.stale-token")
        expired = make_provider(arm, clock, credential=stale, authentication_policy=BearerOverHttp(stale, scope))
        with pytest.raises(CredentialsError) as rejected:
            expired.launch(pool, 1)
        nobody = StaticCredential(None)
        logged_out = make_provider(arm, clock, credential=nobody, authentication_policy=BearerOverHttp(nobody, scope))
        with pytest.raises(CredentialsError) as refused:
            logged_out.launch(pool, 1)
    assert "ExpiredAuthenticationToken" in str(rejected.value) and "az login" in str(rejected.value)
    assert "pool 't4-spot'" in str(refused.value) and "az login" in str(refused.value)
    assert "eyJ.stale-token" not in str(rejected.value) + caplog.text
    fresh = StaticCredential("eyJ.fresh-token")
    assert (
        len(
            make_provider(arm, clock, credential=fresh, authentication_policy=BearerOverHttp(fresh, scope)).launch(
                pool, 1
            )
        )
        == 1
    )
