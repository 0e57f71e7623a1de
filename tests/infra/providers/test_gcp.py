"""GcpProvider through the real google-cloud-compute / google-cloud-billing SDKs against the local
fake Compute Engine (`tests/fakes/gce.py`) and Billing Catalog (`tests/fakes/prices.py`)."""

from __future__ import annotations

import logging
import re

import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.oauth2.credentials import Credentials as UserCredentials

from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.errors import CredentialsError, PoolConfigError
from infra.providers.gcp import GcpProvider
from infra.providers.interface import BootFile, BootPlan
from infra.providers.pool import PoolSpec
from infra.providers.prices_live import offline_price
from infra.providers.startup import LOCK_ENV, WHEEL_ENV
from infra.providers.zonal import LABEL_POOL, LABEL_RUN, LABEL_STEP
from infra.services.ports import free_port
from tests.fakes.gce import FakeGce
from tests.fakes.prices import FakeBillingCatalog, gcp_sku
from tests.fakes.support import serving
from tests.helpers import Clock

RUN = "Run-42"
"""Not a valid label value as is: the provider must sanitise it."""


def gcp_pool(**overrides: object) -> PoolSpec:
    gcp = {
        "project": "rollout-proj",
        "zones": ["us-central1-a", "us-central1-b"],
        "image": "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570",
        "accelerator_type": "nvidia-tesla-t4",
        "service_account": "rollout@rollout-proj.iam.gserviceaccount.com",
    }
    gcp |= overrides.pop("gcp", {})  # type: ignore[arg-type]
    fields = {
        "name": "t4-spot",
        "provider": "gcp",
        "capacity_class": "spot",
        "size": 4,
        "machine_type": "n1-standard-4",
        "price_per_hour": 0.2,
        "gcp": gcp,
    }
    return PoolSpec.model_validate(fields | overrides)


@pytest.fixture
def catalog():
    with serving(FakeBillingCatalog()) as fake:
        yield fake


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def make_provider(gce: FakeGce, clock: Clock, *, billing_url: str | None = None, **kwargs: object) -> GcpProvider:
    defaults: dict[str, object] = {
        "run_id": RUN,
        "bootstrap": WorkerBootstrap(install="image", prefect_api_url="http://prefect.internal:4200/api"),
        "credentials": AnonymousCredentials(),
        "client_options": ClientOptions(api_endpoint=gce.url),
        "billing_client_options": ClientOptions(api_endpoint=billing_url or closed_port_url()),
        "live_prices": billing_url is not None,
        "clock": clock,
        "sleep": lambda s: None,
        "backoff_s": 60.0,
    }
    return GcpProvider(**(defaults | kwargs))  # type: ignore[arg-type]


def insert_bodies(gce: FakeGce) -> list[dict]:
    return [r.body for r in gce.requests_to("POST", r"/instances$")]


class ShippingHooks:
    """Boot hooks that give every VM the run's wheel and lock (as `infra.fleet.cloud_boot` does)."""

    wheel = BootFile(
        "rlboost-0.1.0-py3-none-any.whl",
        "gs://rollout-store/code/ab12/rlboost-0.1.0-py3-none-any.whl",
        "ab12",
        WHEEL_ENV,
    )
    lock = BootFile("requirements.txt", "gs://rollout-store/code/cd34/requirements.txt", "cd34", LOCK_ENV)

    def before_boot(self, pool, instance_id: str) -> BootPlan:
        return BootPlan(files=(self.wheel, self.lock), env={"RLBOOST_FLOW_RUN_ID": f"run-of-{instance_id}"})

    def never_booted(self, instance_id: str, why: str) -> None:
        pass


def test_spot_launch_asks_for_spot_gpus_labels_and_the_worker(gce, clock):
    changes = []
    bootstrap = WorkerBootstrap(prefect_api_url="http://prefect.internal:4200/api")
    provider = make_provider(
        gce, clock, current_step=lambda: 7, on_change=changes.append, bootstrap=bootstrap, boot_hooks=ShippingHooks()
    )
    pool = gcp_pool()
    handles = provider.launch(pool, 2)
    assert len(handles) == 2 and all(h.instance_id.startswith("t4-spot-") for h in handles)
    bodies = insert_bodies(gce)
    assert len(bodies) == 2
    body = bodies[0]
    assert body["scheduling"] == {
        "provisioningModel": "SPOT",
        "instanceTerminationAction": "DELETE",
        "automaticRestart": False,
        "onHostMaintenance": "TERMINATE",
    }
    assert body["machineType"] == "zones/us-central1-a/machineTypes/n1-standard-4"
    assert body["guestAccelerators"] == [
        {"acceleratorType": "zones/us-central1-a/acceleratorTypes/nvidia-tesla-t4", "acceleratorCount": 1}
    ]
    assert body["labels"] == {LABEL_RUN: "run-42", LABEL_POOL: "t4-spot", LABEL_STEP: "7"}
    disk = body["disks"][0]
    assert disk["boot"] and disk["autoDelete"] and disk["initializeParams"]["sourceImage"] == gcp_pool().gcp.image
    assert body["serviceAccounts"] == [
        {
            "email": "rollout@rollout-proj.iam.gserviceaccount.com",
            "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
        }
    ]
    script = next(i["value"] for i in body["metadata"]["items"] if i["key"] == "startup-script")
    # The run's own wheel, fetched from the store, checked, installed without asking an index for the project.
    assert "gcloud storage cp --quiet gs://rollout-store/code/ab12/rlboost-0.1.0-py3-none-any.whl" in script
    assert f"rlboost_verify /opt/rlboost/boot/rlboost-0.1.0-py3-none-any.whl.part-{body['name']} ab12" in script
    assert '--no-deps --force-reinstall "$RLBOOST_WHEEL"' in script and "pip install rlboost" not in script
    assert f"export RLBOOST_FLOW_RUN_ID=run-of-{body['name']}" in script
    assert (
        f"-m infra.services.prefect_worker --pool t4-spot --work-queue {RUN}-{body['name']} --name {body['name']} --limit 1 --run-once"
        in script
    )
    assert "-m infra.watchers gce" in script and "PREFECT_API_URL=http://prefect.internal:4200/api" in script
    # Every insert carried an idempotency key and was waited on through the zone operations API.
    assert all(re.fullmatch(r"[0-9a-f-]{36}", r.query["requestId"]) for r in gce.requests_to("POST", r"/instances$"))
    assert len(gce.requests_to("POST", r"/operations/[^/]+/wait$")) == 2 * gce.operation_polls
    records = provider.instances()
    assert {r.zone for r in records} == {"us-central1-a"} and {r.launch_step for r in records} == {7}
    assert all(
        r.state == "running" and r.launched_at == clock.t and r.price_per_hour == pytest.approx(0.2) for r in records
    )
    assert sorted(gce.names("us-central1-a")) == sorted(h.instance_id for h in handles)
    assert [c.state for c in changes] == ["running", "running"]


def test_standard_pool_asks_for_standard_provisioning(gce, clock):
    provider = make_provider(gce, clock)
    provider.launch(gcp_pool(capacity_class="ondemand", gcp={"accelerator_type": None}), 1)
    (body,) = insert_bodies(gce)
    assert body["scheduling"] == {
        "provisioningModel": "STANDARD",
        "automaticRestart": True,
        "onHostMaintenance": "TERMINATE",
    }
    assert "guestAccelerators" not in body


def test_exhausted_zone_fails_over_to_the_next_and_backs_off(gce, clock, caplog):
    provider = make_provider(gce, clock)
    pool = gcp_pool()
    gce.exhaust("us-central1-a")
    with caplog.at_level(logging.WARNING):
        handles = provider.launch(pool, 2)
    assert [provider.describe(h.instance_id).zone for h in handles] == ["us-central1-b"] * 2
    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in caplog.text
    zones_asked = [r.path.split("/")[6] for r in gce.requests_to("POST", r"/instances$")]
    assert zones_asked == ["us-central1-a", "us-central1-a", "us-central1-b", "us-central1-b"]
    # Within the back-off, zone a is not even asked.
    gce.restore("us-central1-a")
    provider.launch(pool, 1)
    assert gce.requests_to("POST", r"/instances$")[-1].path.split("/")[6] == "us-central1-b"
    # After it, zone a is first again.
    clock.advance(61)
    (handle,) = provider.launch(pool, 1)
    assert provider.describe(handle.instance_id).zone == "us-central1-a"


class RecordingHooks:
    """Boot hooks that record what they were asked (the real ones create Prefect flow runs)."""

    def __init__(self, gce: FakeGce) -> None:
        self.gce = gce
        self.prepared: list[str] = []
        self.undone: list[tuple[str, str]] = []

    def before_boot(self, pool, instance_id: str) -> None:
        assert not any(name == instance_id for _, name in self.gce.instances), "prepared after the VM exists"
        self.prepared.append(instance_id)

    def never_booted(self, instance_id: str, why: str) -> None:
        self.undone.append((instance_id, why))


def test_boot_hooks_prepare_every_vm_before_it_exists_and_undo_the_ones_a_zone_refused(gce, clock):
    hooks = RecordingHooks(gce)
    provider = make_provider(gce, clock, boot_hooks=hooks)
    gce.exhaust("us-central1-a")
    handles = provider.launch(gcp_pool(), 2)
    # Two names tried in zone a (refused, undone), then two fresh names in zone b (created).
    created = [h.instance_id for h in handles]
    assert len(hooks.prepared) == 4 and hooks.prepared[2:] == created
    assert [name for name, _ in hooks.undone] == hooks.prepared[:2]
    assert all("ZONE_RESOURCE_POOL_EXHAUSTED" in why for _, why in hooks.undone)

    class Refusing(RecordingHooks):
        def before_boot(self, pool, instance_id: str) -> None:
            raise RuntimeError("no Prefect server")

    refusing = make_provider(gce, clock, boot_hooks=Refusing(gce), run_id="other-run")
    with pytest.raises(RuntimeError, match="no Prefect server"):
        refusing.launch(gcp_pool(), 1)
    assert len(gce.names()) == 2, "a VM whose work could not be prepared is not created"


def test_quota_blocks_every_zone_of_the_region(gce, clock):
    provider = make_provider(gce, clock)
    pool = gcp_pool(gcp={"zones": ["us-central1-a", "us-central1-b", "us-east1-c"]})
    gce.exceed_quota("us-central1")
    (handle,) = provider.launch(pool, 1)
    assert provider.describe(handle.instance_id).zone == "us-east1-c"
    assert [r.path.split("/")[6] for r in gce.requests_to("POST", r"/instances$")] == ["us-central1-a", "us-east1-c"]


@pytest.mark.parametrize(
    "status,reason,skipped",
    [
        (429, "rateLimitExceeded", []),  # throttled: only that zone backs off
        (403, "quotaExceeded", ["us-central1-b"]),  # a regional quota: the region backs off
    ],
)
def test_immediate_throttling_and_quota_errors_fail_over(gce, clock, status, reason, skipped):
    provider = make_provider(gce, clock)
    pool = gcp_pool(gcp={"zones": ["us-central1-a", "us-central1-b", "us-east1-c"]})
    gce.refusals["us-central1-a"] = (status, reason, f"{reason} for the test")
    (handle,) = provider.launch(pool, 1)
    expected = "us-east1-c" if skipped else "us-central1-b"
    assert provider.describe(handle.instance_id).zone == expected
    asked = [r.path.split("/")[6] for r in gce.requests_to("POST", r"/instances$")]
    assert asked == ["us-central1-a", expected]


def test_every_zone_out_starts_nothing_and_asks_nothing_during_back_off(gce, clock):
    provider = make_provider(gce, clock)
    pool = gcp_pool()
    gce.exhaust("us-central1-a")
    gce.exhaust("us-central1-b")
    assert provider.launch(pool, 2) == []
    asked = len(gce.requests_to("POST", r"/instances$"))
    assert provider.launch(pool, 2) == []
    assert len(gce.requests_to("POST", r"/instances$")) == asked
    assert provider.instances() == []


def test_preemption_is_detected_from_status_and_the_preempted_operation(gce, clock):
    changes = []
    provider = make_provider(gce, clock, on_change=changes.append)
    pool = gcp_pool(notice_s=30.0)
    (handle,) = provider.launch(pool, 1)
    name = handle.instance_id
    clock.advance(100)
    gce.preempt(name)
    notice_at = clock.t
    clock.advance(5)
    provider.refresh()
    record = provider.describe(name)
    assert (record.state, record.reason, record.notice_at) == (
        "terminating",
        "preempted",
        pytest.approx(notice_at, abs=1e-3),
    )
    (event,) = provider.preemptions()
    assert (event.instance_id, event.silent, event.kill_at) == (name, False, pytest.approx(notice_at + 30, abs=1e-3))
    assert provider.preemptions() == []
    gce.settle()
    clock.advance(30)
    provider.refresh()
    record = provider.describe(name)
    assert (record.state, record.terminated_at, record.reason) == ("terminated", clock.t, "preempted")
    assert [(c.state, c.reason) for c in changes] == [
        ("running", None),
        ("terminating", "preempted"),
        ("terminated", "preempted"),
    ]
    assert provider.instances(live_only=True) == []


def test_a_vm_gone_without_a_trace_is_a_silent_preemption(gce, clock):
    provider = make_provider(gce, clock)
    (handle,) = provider.launch(gcp_pool(), 1)
    gce.vanish(handle.instance_id)
    provider.refresh()
    record = provider.describe(handle.instance_id)
    assert (record.state, record.reason) == ("terminated", "preempted_silent")
    assert [e.silent for e in provider.preemptions()] == [True]


def test_terminate_deletes_and_the_record_ends_once_the_vm_is_gone(gce, clock):
    provider = make_provider(gce, clock)
    (handle,) = provider.launch(gcp_pool(), 1)
    provider.terminate(handle.instance_id)
    assert len(gce.requests_to("DELETE", rf"/instances/{handle.instance_id}$")) == 1
    provider.refresh()
    assert provider.describe(handle.instance_id).state == "terminating"  # still STOPPING in the cloud
    gce.settle()
    provider.refresh()
    record = provider.describe(handle.instance_id)
    assert (record.state, record.reason) == ("terminated", "scaled_down")
    assert provider.preemptions() == []
    provider.terminate(handle.instance_id)  # a no-op now
    assert len(gce.requests_to("DELETE", r"/instances/")) == 1


def test_a_new_controller_adopts_the_runs_vms(gce, clock):
    pool = gcp_pool()
    first = make_provider(gce, clock, current_step=lambda: 3)
    launched = {h.instance_id for h in first.launch(pool, 2)}
    other_run = make_provider(gce, clock, run_id="another-run")
    other_run.launch(pool, 1)
    clock.advance(500)
    second = make_provider(gce, clock)
    second.refresh([pool])
    adopted = second.instances()
    assert {r.instance_id for r in adopted} == launched
    assert all(r.launch_step == 3 and r.launched_at == pytest.approx(clock.t - 500, abs=1e-3) for r in adopted)
    list_filter = gce.requests_to("GET", r"/instances$")[-1].query["filter"]
    assert list_filter == '(labels.rlboost-run = "run-42") (labels.rlboost-pool = "t4-spot")'


def test_live_price_sums_the_machine_types_parts_from_the_billing_catalog(gce, clock, catalog):
    region = "us-central1"
    catalog.skus = [
        gcp_sku(
            "Spot Preemptible N1 Predefined Instance Core running in Americas",
            "Preemptible",
            region,
            "h",
            0.0075,
            "N1Standard",
        ),
        gcp_sku("N1 Predefined Instance Core running in Americas", "OnDemand", region, "h", 0.0316, "N1Standard"),
        gcp_sku(
            "Spot Preemptible N1 Predefined Instance Core running in Virginia",
            "Preemptible",
            "us-east4",
            "h",
            0.009,
            "N1Standard",
        ),
        gcp_sku(
            "Spot Preemptible N1 Predefined Instance Ram running in Americas",
            "Preemptible",
            region,
            "GiBy.h",
            0.001,
            "N1Standard",
        ),
        gcp_sku("N1 Predefined Instance Ram running in Americas", "OnDemand", region, "GiBy.h", 0.0042, "N1Standard"),
        gcp_sku("Spot Preemptible Nvidia Tesla T4 GPU running in Americas", "Preemptible", region, "h", 0.14, "GPU"),
        gcp_sku("Nvidia Tesla T4 GPU running in Americas", "OnDemand", region, "h", 0.35, "GPU"),
    ]
    provider = make_provider(gce, clock, billing_url=catalog.url)
    spot = 4 * 0.0075 + 15 * 0.001 + 0.14  # n1-standard-4: 4 vCPUs, 15 GiB; one T4
    assert provider.quote(gcp_pool()) == pytest.approx(spot)
    assert len(catalog.requests) == 4  # seven SKUs, two per page
    assert provider.quote(gcp_pool()) == pytest.approx(spot)
    assert len(catalog.requests) == 4  # cached
    ondemand = 4 * 0.0316 + 15 * 0.0042 + 0.35
    assert provider.quote(gcp_pool(name="t4-standard", capacity_class="ondemand")) == pytest.approx(ondemand)
    assert len(gce.requests_to("GET", r"/machineTypes/n1-standard-4$")) == 2  # once per pool and zone


def test_quote_falls_back_to_the_offline_price_when_the_catalog_is_unreachable(gce, clock, caplog):
    provider = make_provider(gce, clock, billing_url=closed_port_url())
    listed = gcp_pool(machine_type="g2-standard-8", gcp={"accelerator_type": None})
    with caplog.at_level(logging.WARNING):
        price = provider.quote(listed)
    assert price == pytest.approx(offline_price(listed, "us-central1-a"))
    assert price != listed.price_per_hour  # the bundled catalog knows g2-standard-8
    assert "no live price" in caplog.text
    unlisted = gcp_pool(name="t4-other")
    assert provider.quote(unlisted) == unlisted.price_per_hour  # n1-standard-4 is in no catalog: the pool's price


def test_unknown_machine_type_is_a_pool_error_naming_the_fix(gce, clock, catalog):
    pool = gcp_pool(machine_type="n1-bogus-3")
    with pytest.raises(PoolConfigError) as info:
        make_provider(gce, clock, billing_url=catalog.url).quote(pool)
    message = str(info.value)
    assert "pool 't4-spot'" in message and "n1-bogus-3" in message and "gcloud compute machine-types list" in message
    with pytest.raises(PoolConfigError) as info:
        make_provider(gce, clock).launch(pool, 1)
    assert "pool 't4-spot'" in str(info.value) and "set machine_type" in str(info.value)


def test_unknown_project_is_a_pool_error_naming_the_setting(gce, clock):
    with pytest.raises(PoolConfigError) as info:
        make_provider(gce, clock).launch(gcp_pool(gcp={"project": "missing-proj"}), 1)
    assert "pool 't4-spot'" in str(info.value) and "gcp.project (missing-proj)" in str(info.value)


def user_credentials(gce: FakeGce, *, token: str | None, refresh_token: str) -> UserCredentials:
    return UserCredentials(
        token=token,
        refresh_token=refresh_token,
        token_uri=f"{gce.url}/token",
        client_id="client-id.apps.googleusercontent.com",
        client_secret="client-secret-value",
    )


def test_expired_or_revoked_credentials_are_a_clear_error_without_secrets(gce, clock, caplog):
    gce.token = "ya29.fresh-access-token"
    gce.refresh_tokens = {"1//valid-refresh-token"}
    pool = gcp_pool()
    with caplog.at_level(logging.DEBUG):
        stale = make_provider(
            gce, clock, credentials=user_credentials(gce, token="ya29.stale-token", refresh_token="1//x")
        )
        with pytest.raises(CredentialsError) as rejected:
            stale.launch(pool, 1)
        revoked = make_provider(
            gce, clock, credentials=user_credentials(gce, token=None, refresh_token="1//revoked-refresh")
        )
        with pytest.raises(CredentialsError) as refused:
            revoked.launch(pool, 1)
    for error in (rejected, refused):
        assert "pool 't4-spot'" in str(error.value) and "gcloud auth application-default login" in str(error.value)
    assert "expired or been revoked" in str(refused.value)
    shown = str(rejected.value) + str(refused.value) + caplog.text
    for secret in ("ya29.stale-token", "1//revoked-refresh", "client-secret-value", "ya29.fresh-access-token"):
        assert secret not in shown
    # A valid refresh token gets a fresh access token, which the API accepts.
    good = make_provider(
        gce, clock, credentials=user_credentials(gce, token=None, refresh_token="1//valid-refresh-token")
    )
    assert len(good.launch(pool, 1)) == 1
    assert gce.requests_to("POST", r"/instances$")[-1].headers["authorization"] == "Bearer ya29.fresh-access-token"


def test_missing_default_credentials_say_how_to_log_in(gce, clock, monkeypatch, tmp_path):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    provider = make_provider(gce, clock, credentials=None)
    with pytest.raises(CredentialsError) as info:
        provider.launch(gcp_pool(), 1)
    assert "no Google Cloud credentials found" in str(info.value) and "pool 't4-spot'" in str(info.value)


def test_a_pool_of_another_provider_is_refused(gce, clock):
    local = PoolSpec(name="local", capacity_class="spot", size=1, machine_type="x", price_per_hour=0.1)
    with pytest.raises(ValueError, match="provider local"):
        make_provider(gce, clock).launch(local, 1)
