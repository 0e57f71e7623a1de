"""The VM sweep against the local GCP and Azure fakes (real SDKs, the fakes check every request):
VMs of an ended run and of a run whose driver is gone are deleted and recorded in the ledger; a
live run's and an unknown run's are kept; a resumed run adopts its own (its provider picks them up)
instead of deleting them; `--dry-run` lists all with the reason and deletes nothing; the GCP list
asks the API for the VMs that carry the run label, in each zone of the pool."""

from __future__ import annotations

import json

import pytest
import yaml
from azure.core.pipeline.policies import SansIOHTTPPolicy
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from typer.testing import CliRunner

from infra.cli.app import app
from infra.ledger.reader import list_runs, list_swept
from infra.ledger.recorder import Ledger
from infra.providers.zonal import OperationPolling
from infra.run.fabric_config import SweepSettings
from infra.run.sweep import CloudSweep, SweepSchedule
from tests.fakes.gce import FakeGce
from tests.fakes.support import serving
from tests.helpers import wait_for
from tests.infra.providers import test_azure, test_gcp

STALE_S = 900.0
SETTINGS = SweepSettings(interval_s=60.0, stale_after_s=STALE_S)


@pytest.fixture
def arm(clock):
    from tests.fakes.arm import FakeArm

    with serving(FakeArm(clock=clock)) as fake:
        yield fake


@pytest.fixture
def ledger(tmp_path):
    with Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as opened:
        yield opened


def options(gce, arm):
    return {
        "gcp": {
            "credentials": AnonymousCredentials(),
            "client_options": ClientOptions(api_endpoint=gce.url),
            "live_prices": False,
            "sleep": lambda s: None,
        },
        "azure": {
            "credential": test_azure.StaticCredential("unused"),
            "base_url": arm.url,
            "authentication_policy": SansIOHTTPPolicy(),
            "live_prices": False,
            "polling": OperationPolling(interval_s=0.0, timeout_s=10.0, request_timeout_s=10.0),
        },
    }


GCP = test_gcp.gcp_pool(size=1)
AZURE = test_azure.azure_pool(size=1)


def launch(gce, arm, clock, run_id: str) -> set[str]:
    """One VM of `run_id` on each cloud; their names."""
    gcp = test_gcp.make_provider(gce, clock, run_id=run_id).launch(GCP, 1)
    azure = test_azure.make_provider(arm, clock, run_id=run_id).launch(AZURE, 1)
    return {h.instance_id for h in gcp + azure}


@pytest.fixture
def fleet(gce, arm, clock, ledger):
    """VMs of five runs: ended, driver gone, alive, unknown to the ledger, and `resumed` (whose
    crashed session's heartbeat is stale: it is the run that sweeps in the tests)."""
    start = clock.t
    vms = {run: launch(gce, arm, clock, run) for run in ("ended", "gone", "alive", "unknown", "resumed")}
    for run in ("ended", "gone", "alive", "resumed"):
        ledger.heartbeat(run, at=start, name=run)
    clock.advance(STALE_S + 100)
    ledger.finish_run("ended", ended_at=clock.t - 50)
    ledger.heartbeat("alive", at=clock.t - 30)
    return vms


def deleted(gce, arm) -> set[str]:
    return {r.path.rsplit("/", 1)[1] for r in gce.requests_to("DELETE", r"/instances/")} | {
        r.path.rsplit("/", 1)[1] for r in arm.requests_to("DELETE", r"/virtualMachines/")
    }


def test_the_sweep_deletes_the_vms_of_ended_and_abandoned_runs_and_records_them(gce, arm, clock, ledger, fleet):
    sweep = CloudSweep([GCP, AZURE], ledger, SETTINGS, run_id="resumed", options=options(gce, arm), clock=clock)
    items = sweep.sweep()
    verdicts = {item.vm.name: item.verdict for item in items}
    assert set(verdicts) == set().union(*fleet.values())
    assert deleted(gce, arm) == fleet["ended"] | fleet["gone"]
    for run, action in [("ended", "delete"), ("gone", "delete"), ("alive", "keep"), ("unknown", "keep")]:
        assert {verdicts[name].action for name in fleet[run]} == {action}, run
    assert {verdicts[name].action for name in fleet["resumed"]} == {"adopt"}
    assert all("ended 50 s ago" in verdicts[name].why for name in fleet["ended"])
    assert all("driver is gone" in verdicts[name].why for name in fleet["gone"])

    swept = {(row.provider, row.instance_id): row for row in list_swept(ledger.engine)}
    assert {name for _, name in swept} == fleet["ended"] | fleet["gone"]
    assert {provider for provider, _ in swept} == {"gcp", "azure"}
    row = next(r for r in swept.values() if r.run_label == "gone" and r.provider == "gcp")
    assert (row.pool_label, row.swept_by, row.zone) == ("t4-spot", "resumed", "us-central1-a")
    assert row.swept_at.timestamp() == pytest.approx(clock.t)

    # The GCP list asked the API for labelled VMs only, in every zone of the pool.
    lists = [r for r in gce.requests_to("GET", r"/instances$") if r.query.get("filter") == "labels.rlboost-run:*"]
    assert {r.path.split("/zones/")[1].split("/")[0] for r in lists} == set(GCP.zones)


def test_a_resumed_run_is_alive_again_and_its_provider_adopts_its_vms(gce, arm, clock, ledger, fleet):
    ledger.finish_run("resumed", ended_at=clock.t - 10)  # even a run that had ended, resumed with its id
    sweep = CloudSweep([GCP, AZURE], ledger, SETTINGS, run_id="resumed", options=options(gce, arm), clock=clock)
    schedule = SweepSchedule(sweep, "resumed", "resumed")
    try:
        items = schedule.start()
    finally:
        schedule.stop()
    assert not fleet["resumed"] & deleted(gce, arm)
    assert {i.verdict.action for i in items if i.vm.name in fleet["resumed"]} == {"adopt"}
    run = next(r for r in list_runs(ledger.engine) if r.run_id == "resumed")
    assert run.ended_at is None and run.heartbeat_at.timestamp() == pytest.approx(clock.t)
    provider = test_gcp.make_provider(gce, clock, run_id="resumed")
    provider.refresh([GCP])
    assert {r.instance_id for r in provider.instances()} == {n for n in fleet["resumed"] if n in gce.names()}
    # Another sweeper sees the resumed run alive now, so keeps its VMs.
    other = CloudSweep([GCP, AZURE], ledger, SETTINGS, options=options(gce, arm), clock=clock)
    assert {i.verdict.action for i in other.plan() if i.vm.name in fleet["resumed"]} == {"keep"}


def test_the_schedule_beats_and_sweeps_again_while_the_run_runs(gce, arm, clock, ledger, fleet):
    fast = SweepSettings(interval_s=0.05, stale_after_s=STALE_S)
    sweep = CloudSweep([GCP], ledger, fast, run_id="resumed", options=options(gce, arm), clock=clock)
    schedule = SweepSchedule(sweep, "resumed")
    schedule.start()
    try:
        first = len(gce.requests_to("GET", r"/instances$"))
        late = test_gcp.make_provider(gce, clock, run_id="gone").launch(GCP, 1)[0].instance_id  # a leak after the start
        wait_for(lambda: late in deleted(gce, arm), "the next scheduled sweep to delete the late VM", timeout_s=30)
        assert len(gce.requests_to("GET", r"/instances$")) > first
    finally:
        schedule.stop()


def test_rlboost_cloud_sweep_dry_run_lists_and_deletes_nothing_then_sweeps(tmp_path, clock, monkeypatch):
    from tests.infra.run.test_cloud_fabric_e2e import service_account_key

    with serving(FakeGce(clock=clock, token="ya29.fake", operation_polls=1)) as gce:
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(service_account_key(gce, tmp_path / "key.json")))
        credentials_free = test_gcp.make_provider(gce, clock, run_id="gone", credentials=None)
        gone = credentials_free.launch(GCP, 1)[0].instance_id
        db = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
        with Ledger(db) as ledger:
            ledger.heartbeat("gone", at=clock.t - 2 * STALE_S)
        config = tmp_path / "run.yaml"
        pool = json.loads(GCP.model_dump_json())
        config.write_text(
            yaml.safe_dump(
                {
                    "fabric": {
                        "enabled": True,
                        "pools": [pool],
                        "cloud": {"gcp_api_endpoint": gce.url, "live_prices": False},
                    }
                }
            )
        )
        runner = CliRunner()
        dry = runner.invoke(app, ["cloud", "sweep", "--config", str(config), "--db", db, "--dry-run"])
        assert dry.exit_code == 0, dry.output
        assert gone in dry.output and "would delete" in dry.output and "driver is gone" in dry.output
        assert not gce.requests_to("DELETE", r"/instances/")
        real = runner.invoke(app, ["cloud", "sweep", "--config", str(config), "--db", db])
        assert real.exit_code == 0, real.output
        assert [r.path.rsplit("/", 1)[1] for r in gce.requests_to("DELETE", r"/instances/")] == [gone]
        with Ledger(db) as ledger:
            assert [(r.instance_id, r.swept_by) for r in list_swept(ledger.engine)] == [(gone, "cli")]


def test_rlboost_cloud_sweep_without_cloud_pools_exits_2():
    result = CliRunner().invoke(app, ["cloud", "sweep"])
    assert result.exit_code == 2 and "no cloud pools" in result.output
