"""The capacity manager: its planning against a scripted in-memory provider, and end to end with
the GCP provider and the fake Compute Engine through preemptions and a zone running out."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials

from infra.fleet.capacity_manager import CapacityManager
from infra.ledger.recorder import Ledger
from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.errors import PoolConfigError
from infra.providers.gcp import GcpProvider
from infra.providers.interface import InstanceHandle, InstanceRecord, PreemptionEvent, Provider, StopReason
from infra.providers.pool import PoolSpec
from infra.run.fabric_config import CapacitySettings
from infra.weights.updates import UpdateMeter
from tests.fakes.gce import FakeGce
from tests.fakes.support import serving
from tests.helpers import Clock, wait_for


class ScriptedProvider(Provider):
    """Instances that start and stop at once; `capacity` caps what a pool can start; `prices` quote."""

    def __init__(self, clock: Clock, prices: dict[str, float], capacity: dict[str, int] | None = None) -> None:
        self.clock = clock
        self.prices = prices
        self.capacity = dict(capacity or {})
        self.records: dict[str, InstanceRecord] = {}
        self.events: list[PreemptionEvent] = []
        self.refreshed = 0

    def launch(self, pool: PoolSpec, count: int) -> list[InstanceHandle]:
        room = self.capacity.get(pool.name, count)
        started = []
        for _ in range(min(count, room)):
            record = InstanceRecord(
                f"{pool.name}-{len(self.records)}",
                pool.name,
                pool.capacity_class,
                pool.machine_type,
                self.prices[pool.name],
                launched_at=self.clock(),
            )
            self.records[record.instance_id] = record
            started.append(record)
        if pool.name in self.capacity:
            self.capacity[pool.name] -= len(started)
        return started

    def instances(self, live_only: bool = False) -> list[InstanceRecord]:
        return [r for r in self.records.values() if not live_only or r.state != "terminated"]

    def describe(self, instance_id: str) -> InstanceRecord:
        return self.records[instance_id]

    def terminate(self, instance_id: str, reason: StopReason = "scaled_down") -> None:
        self.records[instance_id] = replace(
            self.records[instance_id], state="terminated", reason=reason, terminated_at=self.clock()
        )

    def preempt(self, instance_id: str) -> None:
        self.terminate(instance_id, "preempted")
        record = self.records[instance_id]
        self.events.append(PreemptionEvent(instance_id, record.pool, self.clock(), self.clock() + 30, False))

    def preemptions(self) -> list[PreemptionEvent]:
        events, self.events = self.events, []
        return events

    def quote(self, pool: PoolSpec) -> float:
        return self.prices[pool.name]

    def refresh(self, pools: Sequence[PoolSpec] = ()) -> None:
        self.refreshed += 1


def pool(name: str, size: int = 3, **fields: object) -> PoolSpec:
    return PoolSpec.model_validate(
        {"name": name, "capacity_class": "spot", "size": size, "machine_type": "g2-standard-8", "price_per_hour": 0.5}
        | fields
    )


def running(provider: Provider, name: str) -> list[str]:
    return sorted(r.instance_id for r in provider.instances(live_only=True) if r.pool == name and r.state == "running")


def test_fills_every_pool_to_its_size_then_holds():
    clock = Clock()
    provider = ScriptedProvider(clock, {"a": 0.3, "b": 0.5})
    manager = CapacityManager(provider, [pool("a"), pool("b", size=2)], clock=clock)
    report = manager.reconcile()
    assert report.targets == {"a": 3, "b": 2} and len(report.launched) == 5
    assert report.quotes == {"a": 0.3, "b": 0.5}
    again = manager.reconcile()
    assert again.launched == () and again.terminated == ()
    assert provider.refreshed == 2


def test_budget_keeps_minimums_first_then_the_cheapest():
    clock = Clock()
    provider = ScriptedProvider(clock, {"cheap": 0.1, "pricey": 0.5})
    manager = CapacityManager(provider, [pool("cheap"), pool("pricey", min_size=1)], budget_per_hour=0.8, clock=clock)
    assert manager.reconcile().targets == {"cheap": 3, "pricey": 1}


def test_a_price_above_the_cap_empties_the_pool():
    clock = Clock()
    provider = ScriptedProvider(clock, {"a": 0.2})
    manager = CapacityManager(provider, [pool("a", min_size=2, max_price_per_hour=0.3)], clock=clock)
    manager.reconcile()
    assert len(running(provider, "a")) == 3
    provider.prices["a"] = 0.4
    report = manager.reconcile()
    assert report.targets == {"a": 0} and sorted(report.terminated) == ["a-0", "a-1", "a-2"]
    assert running(provider, "a") == []


def test_scale_down_stops_the_newest_instances():
    clock = Clock()
    provider = ScriptedProvider(clock, {"a": 1.0})
    CapacityManager(provider, [pool("a")], clock=clock).reconcile()
    provider.records["a-0"] = replace(provider.records["a-0"], launched_at=clock.t - 100)
    provider.records["a-2"] = replace(provider.records["a-2"], launched_at=clock.t + 5)
    report = CapacityManager(provider, [pool("a")], budget_per_hour=1.0, clock=clock).reconcile()
    assert report.targets == {"a": 1} and report.terminated == ("a-2", "a-1")
    assert running(provider, "a") == ["a-0"]


def test_preempted_instances_are_replaced():
    clock = Clock()
    provider = ScriptedProvider(clock, {"a": 0.3})
    manager = CapacityManager(provider, [pool("a")], clock=clock)
    manager.reconcile()
    provider.preempt("a-1")
    report = manager.reconcile()
    assert [e.instance_id for e in report.preemptions] == ["a-1"]
    assert [h.instance_id for h in report.launched] == ["a-3"]
    assert running(provider, "a") == ["a-0", "a-2", "a-3"]


def test_a_pool_that_cannot_deliver_yields_the_budget_to_one_that_can():
    clock = Clock()
    provider = ScriptedProvider(clock, {"a": 1.0, "b": 1.0}, capacity={"a": 0})
    manager = CapacityManager(provider, [pool("a", size=2), pool("b", size=2)], budget_per_hour=2.0, clock=clock)
    assert manager.reconcile().targets == {"a": 2, "b": 0}  # a tie: by name
    clock.advance(60)
    assert manager.reconcile().targets == {"a": 0, "b": 2}
    assert running(provider, "b") == ["b-0", "b-1"]
    clock.advance(3601)  # the failure leaves the history window
    provider.capacity["a"] = 2
    provider.terminate("b-0")
    provider.terminate("b-1")
    assert manager.reconcile().targets == {"a": 2, "b": 0}


def test_a_failed_instance_is_replaced_at_the_reconcile_a_wake_starts_not_at_the_interval():
    clock = Clock()
    provider = ScriptedProvider(clock, {"a": 0.3})
    manager = CapacityManager(provider, [pool("a", size=2)], clock=clock)
    stop = threading.Event()
    loop = threading.Thread(target=manager.run, args=(stop, 3600.0))
    loop.start()
    try:
        wait_for(lambda: running(provider, "a") == ["a-0", "a-1"], "the first reconcile")
        provider.terminate("a-0", "crashed")  # the instance watch stopped a failed instance
        manager.wake()
        wait_for(lambda: running(provider, "a") == ["a-1", "a-2"], "its replacement, well before the hour")
    finally:
        stop.set()
        manager.wake()  # ends the wait at once
        loop.join(timeout=5)
    assert not loop.is_alive()


def test_run_retries_api_failures_and_stops_on_configuration_errors():
    clock = Clock()
    provider = ScriptedProvider(clock, {"a": 0.3})
    failures = [RuntimeError("503 from the API"), PoolConfigError("a", "unknown machine type")]

    def flaky_refresh(pools=()):
        raise failures.pop(0)

    provider.refresh = flaky_refresh  # type: ignore[method-assign]
    with pytest.raises(PoolConfigError):
        CapacityManager(provider, [pool("a")], clock=clock).run(threading.Event(), interval_s=0)
    assert failures == []


def test_duplicate_pool_names_are_refused():
    with pytest.raises(ValueError, match="unique"):
        CapacityManager(ScriptedProvider(Clock(), {}), [pool("a"), pool("a")])


# -- end to end: GCP provider + fake Compute Engine -------------------------------------------------


def test_keeps_a_gcp_spot_pool_at_target_through_preemptions_and_a_zone_running_out(tmp_path):
    clock = Clock()
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.start_run("e2e", name="capacity", started_at=clock())
    spot = PoolSpec.model_validate(
        {
            "name": "l4-spot",
            "provider": "gcp",
            "capacity_class": "spot",
            "size": 3,
            "min_size": 3,
            "machine_type": "g2-standard-8",
            "price_per_hour": 0.5,
            "max_price_per_hour": 1.0,
            "notice_s": 30,
            "gcp": {
                "project": "rollout-proj",
                "zones": ["us-central1-a", "us-central1-b"],
                "image": "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570",
            },
        }
    )
    changes: list[InstanceRecord] = []
    with serving(FakeGce(clock=clock)) as gce:
        provider = GcpProvider(
            run_id="e2e",
            bootstrap=WorkerBootstrap(install="image"),
            credentials=AnonymousCredentials(),
            client_options=ClientOptions(api_endpoint=gce.url),
            live_prices=False,
            clock=clock,
            sleep=lambda s: None,
            backoff_s=120.0,
            on_change=lambda r: (changes.append(r), ledger.record_instance("e2e", r, provider="gcp", zone=r.zone)),
        )
        manager = CapacityManager(provider, [spot], clock=clock)

        def zones() -> list[str]:
            return sorted(provider.describe(i).zone for i in running(provider, "l4-spot"))

        report = manager.reconcile()
        assert report.targets == {"l4-spot": 3} and zones() == ["us-central1-a"] * 3
        assert report.quotes["l4-spot"] == pytest.approx(0.479872)  # g2-standard-8 from the bundled catalog

        # A preemption with notice: the VM is STOPPING; a replacement starts at once.
        first = running(provider, "l4-spot")[0]
        clock.advance(600)
        gce.preempt(first)
        report = manager.reconcile()
        assert [e.instance_id for e in report.preemptions] == [first] and len(report.launched) == 1
        assert provider.describe(first).state == "terminating" and len(running(provider, "l4-spot")) == 3

        # The preempted VM is gone; zone a runs out; two more are preempted: both replacements go to b.
        gce.settle()
        gce.exhaust("us-central1-a")
        clock.advance(600)
        lost = running(provider, "l4-spot")[:2]
        for name in lost:
            gce.preempt(name)
        gce.settle()
        report = manager.reconcile()
        assert sorted(e.instance_id for e in report.preemptions) == sorted(lost)
        assert zones() == ["us-central1-a", "us-central1-b", "us-central1-b"]
        assert provider.describe(first).state == "terminated"

        # A silent loss while zone a is backing off: the replacement goes straight to b.
        silent = next(i for i in running(provider, "l4-spot") if provider.describe(i).zone == "us-central1-a")
        gce.vanish(silent)
        clock.advance(60)
        inserts_before = len(gce.requests_to("POST", r"/zones/us-central1-a/instances$"))
        manager.reconcile()
        assert len(gce.requests_to("POST", r"/zones/us-central1-a/instances$")) == inserts_before
        assert zones() == ["us-central1-b"] * 3
        assert provider.describe(silent).reason == "preempted_silent"

        # Zone a recovers and its back-off expires: the next replacement goes back to it.
        gce.restore("us-central1-a")
        clock.advance(180)
        gce.preempt(running(provider, "l4-spot")[0])
        manager.reconcile()
        assert zones() == ["us-central1-a", "us-central1-b", "us-central1-b"]

        # Nothing leaked: the cloud holds exactly the running records, plus the one still stopping.
        assert sorted(gce.names(status="RUNNING")) == running(provider, "l4-spot")
        gce.settle()
        manager.reconcile()

    records = provider.instances()
    assert len(records) == 3 + 1 + 2 + 1 + 1
    for record in records:
        assert record.launched_at is not None and record.price_per_hour == pytest.approx(0.479872)
        if record.state == "terminated":
            assert record.terminated_at >= record.launched_at and record.reason in ("preempted", "preempted_silent")
    ended = [r for r in records if r.state == "terminated"]
    assert len(ended) == 5
    # Every lifecycle step reached the callback, in order, ending with each record's final state.
    for record in records:
        steps = [c for c in changes if c.instance_id == record.instance_id]
        assert steps[-1] == record
        expected = ["running", "terminating", "terminated"] if record.state == "terminated" else ["running"]
        assert [s.state for s in steps] == expected

    # The ledger holds each instance's lifetime and cost, as the provider saw them.
    ledger.finish_run("e2e", ended_at=clock())
    costs = {c.instance_id: c for c in ledger.report("e2e").instances}
    ledger.close()
    assert costs.keys() == {r.instance_id for r in records}
    for record in records:
        end = record.terminated_at if record.terminated_at is not None else clock()
        cost = costs[record.instance_id]
        assert cost.reason == record.reason
        assert cost.billed_seconds == pytest.approx(end - record.launched_at)
        assert cost.spend_usd == pytest.approx(cost.billed_seconds / 3600 * 0.479872)


def test_marginal_policy_grows_on_a_steep_curve_and_drains_before_terminating():
    clock = Clock()
    provider = ScriptedProvider(clock, {"a": 1.0})
    curve: dict[int, float] = {}
    asked: list[str] = []
    manager = CapacityManager(
        provider,
        [pool("a", size=4)],
        clock=clock,
        policy="marginal",
        throughput_curve=lambda: curve,
        base_price_per_hour=10.0,
        drain=asked.append,
        drain_s=60.0,
    )
    assert manager.reconcile().targets == {"a": 0}  # the reserved cluster alone is not measured yet
    curve[0] = 100.0
    assert manager.reconcile().targets == {"a": 1}  # the first instance is explored
    curve[1] = 150.0
    assert manager.reconcile().targets == {"a": 2}
    curve[2] = 200.0
    report = manager.reconcile()
    assert report.targets == {"a": 3} and len(running(provider, "a")) == 3
    provider.prices["a"] = 10.0  # now an instance adds 50 tokens / $10 against the run's 10 / $
    clock.advance(1.0)
    report = manager.reconcile()
    assert report.targets == {"a": 0} and report.terminated == ()
    assert sorted(report.drained) == sorted(asked) == ["a-0", "a-1", "a-2"]
    assert len(running(provider, "a")) == 3  # draining: still running, not counted, not relaunched
    provider.terminate("a-1")  # one finished its work and stopped
    clock.advance(30.0)
    again = manager.reconcile()
    assert again.launched == () and again.drained == () and again.terminated == ()
    clock.advance(30.0)
    late = manager.reconcile()
    assert sorted(late.terminated) == ["a-0", "a-2"] and running(provider, "a") == []


def test_marginal_policy_keeps_the_budget_as_its_ceiling():
    clock = Clock()
    provider = ScriptedProvider(clock, {"a": 1.0})
    curve = {0: 100.0, 1: 150.0, 2: 200.0, 3: 250.0}
    manager = CapacityManager(
        provider,
        [pool("a", size=4)],
        budget_per_hour=2.0,
        clock=clock,
        policy="marginal",
        throughput_curve=lambda: curve,
        base_price_per_hour=10.0,
    )
    assert manager.reconcile().targets == {"a": 2}
    with pytest.raises(ValueError):
        CapacityManager(provider, [pool("a")], clock=clock, policy="marginal")


def test_marginal_policy_holds_the_pool_whose_weight_pulls_cost_less_egress():
    """Two GCP pools at one price, one in the trainer's region (us-central1: its pulls are free),
    one in Europe ($0.05/GB from the bundled table): with the runtime's inputs (the egress prices
    `fabric.capacity` gives the pools, the bytes and pace of the versions a publisher encoded), the
    first instance held is the near one's; without them the pools' names break the tie."""
    clock = Clock()
    image = "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570"
    pools = [
        pool(name, provider="gcp", gcp={"project": "rollout-proj", "zones": [zone], "image": image})
        for name, zone in (("a-europe", "europe-west4-a"), ("b-iowa", "us-central1-a"))
    ]
    prices = CapacitySettings(egress_from="gcp:us-central1").egress_prices(tuple(pools))
    assert prices == {"a-europe": 0.05, "b-iowa": 0.0}
    meter = UpdateMeter(clock)
    meter.encoded(16_000_000_000)  # the first, whole, version: every instance's warm-up
    for _ in range(4):  # then a 2 GB delta every 6 minutes: 10 versions, 20 GB an hour
        clock.advance(360.0)
        meter.encoded(2_000_000_000)

    def manager(egress: dict[str, float] | None) -> CapacityManager:
        return CapacityManager(
            ScriptedProvider(clock, {"a-europe": 1.0, "b-iowa": 1.0}),
            pools,
            clock=clock,
            policy="marginal",
            throughput_curve=lambda: {0: 100.0},
            base_price_per_hour=10.0,
            egress_usd_per_gb=egress,
            weight_updates=meter.updates,
        )

    assert manager(None).reconcile().targets == {"a-europe": 1, "b-iowa": 0}
    report = manager(prices).reconcile()
    assert report.egress_per_hour == pytest.approx({"a-europe": 1.0, "b-iowa": 0.0})  # 20 GB/h x $0.05
    assert report.targets == {"a-europe": 0, "b-iowa": 1}
