"""The pure cost computations of `infra.ledger.report`, on hand-made rows and a stub price list."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from pytest import approx

from infra.ledger.models import Instance, Run, Step, Usage, WeightTransfer
from infra.ledger.reader import RunRecords
from infra.ledger.report import build_report
from infra.pricing import PriceNotFound

T0 = datetime(2025, 6, 1, tzinfo=UTC)


def t(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class StubPrices:
    """Prices per (machine type, class); remembers what it was asked."""

    def __init__(self, prices: dict[tuple[str, str], float]) -> None:
        self.prices = prices
        self.asked: list[tuple] = []

    def price(self, provider, machine_type, region, capacity_class, at):
        self.asked.append((provider, machine_type, region, capacity_class, at))
        try:
            return self.prices[machine_type, capacity_class]
        except KeyError:
            raise PriceNotFound(f"no {capacity_class} price for {machine_type!r}") from None


def instance(
    instance_id: str,
    capacity_class: str,
    price: float | None,
    start: float,
    end: float | None = None,
    reason: str | None = None,
    notice: float | None = None,
    machine_type: str = "g2-standard-8",
    role: str = "rollout",
    ready: float | None = None,
) -> Instance:
    return Instance(
        run_id="r",
        instance_id=instance_id,
        pool=capacity_class,
        role=role,
        provider="gcp",
        zone="us-central1-b",
        machine_type=machine_type,
        capacity_class=capacity_class,
        price_per_hour=price,
        launched_at=t(start),
        ready_at=None if ready is None else t(ready),
        notice_at=None if notice is None else t(notice),
        terminated_at=None if end is None else t(end),
        state="running" if end is None else "terminated",
        reason=reason,
    )


def usage(step: int, instance_id: str, seconds: float, generated: int, wasted: int = 0) -> Usage:
    return Usage(
        run_id="r",
        step=step,
        instance_id=instance_id,
        seconds=seconds,
        tokens_generated=generated,
        tokens_wasted=wasted,
    )


def records(instances, usages, steps=None, transfers=(), ended: float | None = 3600) -> RunRecords:
    steps = steps or [
        Step(run_id="r", step=1, started_at=t(0), ended_at=t(1800), tokens_trained=1000),
        Step(run_id="r", step=2, started_at=t(1800), ended_at=t(3600), tokens_trained=1000),
    ]
    run = Run(run_id="r", name="demo", started_at=t(0), ended_at=None if ended is None else t(ended))
    return RunRecords(run, list(steps), list(instances), list(usages), list(transfers))


CATALOG = StubPrices({("g2-standard-8", "ondemand"): 0.85, ("g2-standard-8", "spot"): 0.25})


def test_step_cost_is_its_instance_seconds_at_each_price_plus_its_egress():
    rows = records(
        [instance("reserved-0", "reserved", 0.80, 0, 3600), instance("spot-0", "spot", 0.20, 0, 3600)],
        [usage(1, "reserved-0", 1800, 500), usage(1, "spot-0", 900, 700), usage(2, "reserved-0", 1800, 600)],
        transfers=[
            WeightTransfer(
                run_id="r", instance_id="spot-0", version=1, source="store", step=1, bytes=5, egress_usd=0.05
            )
        ],
    )
    report = build_report(rows, CATALOG)
    step1, step2 = report.steps
    assert step1.cost_usd == approx(1800 * 0.80 / 3600 + 900 * 0.20 / 3600 + 0.05)  # 0.40 + 0.05 + 0.05
    assert step1.spot_usd == approx(0.05)
    assert step1.trainer_usd == 0
    assert (step1.instances, step1.instance_seconds, step1.tokens_generated) == (2, 2700, 1200)
    assert step1.usd_per_million_generated == approx(0.50 / 1200 * 1e6)
    assert step2.cost_usd == approx(0.40) and step2.spot_usd == 0
    assert (step1.transfer_bytes, step1.pulls, step1.pull_s_max) == (5, 1, None)  # recorded without seconds
    assert (step2.transfer_bytes, step2.pulls, step2.pull_s_max) == (0, 0, None)
    # Billed: reserved 1 h at 0.80 + spot 1 h at 0.20; spot-0 idled 2700 s outside any step.
    assert report.total_usd == approx(0.80 + 0.20 + 0.05)
    assert report.unattributed_usd == approx(2700 * 0.20 / 3600)
    assert report.usd_per_million_trained == approx(1.05 / 2000 * 1e6)
    assert (report.step_seconds, report.trained_tokens_per_s) == (3600, approx(2000 / 3600))
    assert not report.trainer_recorded and report.trainer_usd == 0


def transfer(instance_id: str, version: int, source: str, nbytes: int, seconds: float | None, step: int | None):
    return WeightTransfer(
        run_id="r",
        instance_id=instance_id,
        version=version,
        source=source,
        step=step,
        bytes=nbytes,
        egress_usd=0.0,
        seconds=seconds,
    )


def test_a_steps_pulled_bytes_count_each_pull_once_and_its_slowest_pull():
    """A pull from two sources is two rows carrying the pull's seconds: one pull. Step 1's slowest
    pull is spot-1's 7.5 s; step 2's pull was recorded before migration 0005 (no seconds): its
    slowest is unknown, not 0; a transfer outside the steps is in the run's bytes only."""
    rows = records(
        [instance("spot-0", "spot", 0.20, 0, 3600), instance("spot-1", "spot", 0.20, 0, 3600)],
        [usage(1, "spot-0", 1800, 500), usage(2, "spot-0", 1800, 500)],
        transfers=[
            transfer("spot-0", 1, "store", 3 * 2**20, 2.5, step=1),
            transfer("spot-0", 1, "spot-1", 2**20, 2.5, step=1),
            transfer("spot-1", 1, "store", 4 * 2**20, 7.5, step=1),
            transfer("spot-0", 2, "store", 2**20, None, step=2),
            transfer("spot-1", 0, "store", 9, 1.0, step=None),
        ],
    )
    step1, step2 = build_report(rows, CATALOG).steps
    assert (step1.transfer_bytes, step1.pulls, step1.pull_s_max) == (8 * 2**20, 2, 7.5)
    assert (step2.transfer_bytes, step2.pulls, step2.pull_s_max) == (2**20, 1, None)
    assert build_report(rows, CATALOG).transfer_bytes == 9 * 2**20 + 9


def _field_names(data: object) -> set[str]:
    if isinstance(data, dict):
        return set(data) | {name for value in data.values() for name in _field_names(value)}
    if isinstance(data, list):
        return {name for value in data for name in _field_names(value)}
    return set()


def test_no_figure_re_prices_the_run_at_on_demand_prices():
    """The same instance-seconds at on-demand prices is no on-demand run: nothing reports it, and
    the on-demand price is never asked for (infra.ledger.comparison compares with a measured run)."""
    prices = StubPrices({("g2-standard-8", "ondemand"): 0.85, ("g2-standard-8", "spot"): 0.25})
    rows = records(
        [instance("reserved-0", "reserved", 0.80, 0, 3600), instance("spot-0", "spot", None, 0, 3600)],
        [usage(1, "reserved-0", 1800, 500), usage(1, "spot-0", 900, 700)],
    )
    report = build_report(rows, prices)
    names = _field_names(report.as_dict()) | set(report.summary())
    assert "spend_ondemand_usd" in names  # what on-demand instances did cost stays
    assert not {name for name in names if re.search("ondemand_only|ondemand_usd_per|savings|counterfactual", name)}
    assert [asked[3] for asked in prices.asked] == ["spot"]


def test_the_trainers_machine_is_billed_and_attributed_to_steps_like_any_instance():
    rows = records(
        [
            instance("trainer", "reserved", 3.60, 0, 3600, role="trainer", machine_type="a2-highgpu-1g"),
            instance("spot-0", "spot", 0.20, 0, 1800),
        ],
        [usage(1, "trainer", 1800, 0), usage(1, "spot-0", 1800, 900), usage(2, "trainer", 1800, 0)],
    )
    report = build_report(rows, CATALOG)
    trainer = next(i for i in report.instances if i.role == "trainer")
    assert (trainer.billed_seconds, trainer.spend_usd) == (3600, approx(3.60))
    assert [s.trainer_usd for s in report.steps] == approx([1.80, 1.80])
    assert [s.cost_usd for s in report.steps] == approx([1.80 + 0.10, 1.80])
    assert report.trainer_recorded and report.trainer_usd == approx(3.60) and report.total_usd == approx(3.70)


def test_prices_come_from_the_catalog_when_missing():
    rows = records(
        [
            instance("spot-0", "spot", None, 0, 3600),
            instance("od-0", "ondemand", 1.00, 0, 3600),
            instance("reserved-0", "reserved", 0.50, 0, 3600),
        ],
        [],
    )
    report = build_report(rows, CATALOG)
    by_id = {c.instance_id: c for c in report.instances}
    assert [by_id[i].usd_per_hour for i in ("spot-0", "od-0", "reserved-0")] == [0.25, 1.00, 0.50]
    assert {"reserved": 0.50, "ondemand": 1.00, "spot": 0.25} == {
        c.capacity_class: approx(c.spend_usd) for c in report.classes
    }
    # The catalog is asked with the instance's provider, zone and launch time.
    assert ("gcp", "g2-standard-8", "us-central1-b", "spot", t(0)) in CATALOG.asked


def test_a_missing_price_names_the_instance_and_why_it_is_needed():
    rows = records([instance("spot-7", "spot", None, 0, 60, machine_type="x9-mystery")], [])
    with pytest.raises(
        PriceNotFound,
        match=r"instance spot-7 \(pool spot, spot\) needs a price \(none was recorded\): no spot price for 'x9-mystery'",
    ):
        build_report(rows, CATALOG)


def test_running_instances_are_billed_up_to_as_of_or_the_run_end():
    rows = records([instance("spot-0", "spot", 0.36, 0)], [], ended=1000)
    assert build_report(rows, CATALOG).instances[0].billed_seconds == 1000
    later = build_report(rows, CATALOG, as_of=t(2000))
    assert later.as_of == t(2000) and later.total_usd == approx(2000 * 0.36 / 3600)
    assert (
        build_report(records([instance("spot-0", "spot", 0.36, 500)], [], ended=None), CATALOG, as_of=t(100)).total_usd
        == 0
    )


def test_preemptions_count_in_the_step_of_their_notice_and_evictions_apart():
    rows = records(
        [
            instance("spot-0", "spot", 0.2, 0, 1830, reason="preempted", notice=1800),  # notice at step 2's start
            instance("spot-1", "spot", 0.2, 0, 600, reason="preempted_silent"),  # no notice: its end
            instance("spot-2", "spot", 0.2, 0, 900, reason="evicted"),
            instance("spot-3", "spot", 0.2, 0, 3600, reason="scaled_down"),
        ],
        [],
    )
    report = build_report(rows, CATALOG)
    assert [s.preemptions for s in report.steps] == [1, 1]
    assert (report.preemptions, report.evictions) == (2, 1)
    assert report.classes[0].preemptions == 2


def test_failed_instances_count_as_replaced_in_the_step_they_ended():
    rows = records(
        [
            instance("spot-0", "spot", 0.2, 0, 120, reason="crashed"),  # a worker that exited: step 1
            instance("spot-1", "spot", 0.2, 1800, 1850, reason="crashed"),  # never registered: step 2
            instance("spot-2", "spot", 0.2, 1850, 1900, reason="crashed"),
            instance("spot-3", "spot", 0.2, 0, 600, reason="preempted"),  # not a failure
        ],
        [],
    )
    report = build_report(rows, CATALOG)
    assert [s.replaced for s in report.steps] == [1, 2]
    assert (report.replaced, report.preemptions) == (3, 1)


def test_a_run_without_tokens_or_instances_has_no_ratios():
    untrained = [Step(run_id="r", step=1, started_at=t(0), ended_at=None, tokens_trained=None)]
    report = build_report(records([], [], steps=untrained), CATALOG)
    assert report.total_usd == 0 and report.usd_per_million_generated is None and report.usd_per_million_trained is None
    assert report.trained_tokens_per_s is None and report.classes == []
    summary = report.summary()
    assert summary["spend_spot_usd"] == 0.0 and summary["steps"] == 1 and "instances" not in summary


def test_boot_seconds_are_launch_to_ready_per_class_with_their_cost():
    instances = [
        instance("spot-a", "spot", 0.36, 0, 3600, ready=90),
        instance("spot-b", "spot", 0.36, 600, 3600, ready=900),
        instance("spot-c", "spot", 0.36, 1200, 3600),  # never ready: not counted
        instance("res", "reserved", 1.8, 0, 3600, ready=60),
        instance("od", "ondemand", 0.85, 0, 3600),
    ]
    report = build_report(records(instances, []), CATALOG)
    classes = {c.capacity_class: c for c in report.classes}
    assert (classes["spot"].booted, classes["spot"].boot_s_mean) == (2, approx(195))
    assert classes["spot"].boot_usd == approx(390 * 0.36 / 3600)
    assert (classes["reserved"].booted, classes["reserved"].boot_s_mean) == (1, approx(60))
    assert (classes["ondemand"].booted, classes["ondemand"].boot_s_mean, classes["ondemand"].boot_usd) == (0, None, 0)
    assert {i.instance_id: i.boot_s for i in report.instances}["spot-b"] == approx(300)
