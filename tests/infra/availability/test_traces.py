"""Availability traces: the real shared traces parse with their documented statistics, schedules
compress and loop correctly, bad rows fail with file:line, and the Poisson model is calibrated."""

from __future__ import annotations

import gzip
import math
import re
from pathlib import Path

import pytest

import infra
from infra.availability.traces import (
    SHIPPED_TRACES_DIR,
    AvailabilityTrace,
    CapacityChange,
    PoissonLifetimes,
    TraceError,
    TraceEvent,
    TraceSchedule,
    load_bamboo,
    load_gcloud_log,
    load_skynomad_h100,
    load_spotserve,
    load_trace,
    summarize,
    traces_dir,
)

HOUR = 3600.0


@pytest.fixture(scope="module")
def root() -> Path:
    return traces_dir()


def test_the_traces_ship_with_the_package(monkeypatch):
    """No folder beside the checkout is needed: the default directory is inside the package."""
    monkeypatch.delenv("RLBOOST_TRACES_DIR", raising=False)
    assert traces_dir() == SHIPPED_TRACES_DIR
    assert SHIPPED_TRACES_DIR.is_relative_to(Path(infra.__file__).parent)
    for licence in (
        "bamboo/LICENSE",
        "skynomad/LICENSE",
        "skynomad/NOTICE",
        "spotserve/LICENSE-Apache-2.0.txt",
        "gcp-spot-prices-cyclenerd/LICENSE",
    ):
        assert (SHIPPED_TRACES_DIR / licence).is_file(), licence
    assert load_trace("skynomad/h100/us-central1-a").slots == 16  # read from the shipped .csv.gz


def test_a_gzipped_trace_reads_like_the_plain_file(tmp_path, monkeypatch):
    events = "0,add,a\n0,add,b\n5000,remove,a\n9000,add,c\n"
    (tmp_path / "plain" / "bamboo" / "traces").mkdir(parents=True)
    (tmp_path / "plain" / "bamboo" / "traces" / "tiny-trace.csv").write_text(events)
    (tmp_path / "gz" / "bamboo" / "traces").mkdir(parents=True)
    with gzip.open(tmp_path / "gz" / "bamboo" / "traces" / "tiny-trace.csv.gz", "wt") as f:
        f.write(events)
    plain, compressed = (load_trace("bamboo/tiny", tmp_path / kind) for kind in ("plain", "gz"))
    assert plain.steps == compressed.steps == ((0.0, 2), (5.0, 1), (9.0, 2))


def _capacities(trace: AvailabilityTrace) -> list[int]:
    return [cap for _, cap in trace.steps]


# -- real traces --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "slots", "removes", "hours", "mean_alive"),
    [("bamboo/g4dn", 24, 74, 10.8, 12.6), ("bamboo/p3", 32, 167, 11.4, 24.0)],
)
def test_bamboo_event_traces_match_their_readme(root, ref, slots, removes, hours, mean_alive):
    trace = load_trace(ref, root)
    summary = summarize(trace)
    assert trace.name == ref and trace.slots == slots
    assert summary.preemptions == removes
    assert summary.duration_s / HOUR == pytest.approx(hours, abs=0.1)
    assert summary.mean_capacity == pytest.approx(mean_alive, abs=0.3)
    assert 1.0 * HOUR < summary.mean_lifetime_s < 2.5 * HOUR
    assert all(0 <= cap <= slots for cap in _capacities(trace))


@pytest.mark.parametrize(
    ("name", "low", "high", "mean"), [("v100x1-east1c", 30, 80, 77.4), ("a100x1-east1b", 17, 64, 57.9)]
)
def test_gcloud_pool_logs_are_sorted_step_functions(root, name, low, high, mean):
    trace = load_trace(f"bamboo/gcloud/{name}", root)
    caps = _capacities(trace)
    assert (min(caps), max(caps), trace.slots) == (low, high, high)
    assert summarize(trace).mean_capacity == pytest.approx(mean, abs=2.0)
    assert 20 * HOUR < trace.duration_s < 28 * HOUR


@pytest.mark.parametrize(
    ("zone", "mean_created"), [("us-central1-a", 14.82), ("asia-south2-b", 15.97), ("us-west1-b", 2.62)]
)
def test_skynomad_h100_probe_counts(root, zone, mean_created):
    trace = load_trace(f"skynomad/h100/{zone}", root)
    summary = summarize(trace)
    assert trace.slots == 16
    assert summary.duration_s / (24 * HOUR) == pytest.approx(14.7, abs=0.1)
    assert summary.mean_capacity == pytest.approx(mean_created, abs=0.3)
    assert summary.preemptions > 0 and all(0 <= cap <= 16 for cap in _capacities(trace))


def test_skynomad_unknown_zone_lists_the_zones(root):
    with pytest.raises(TraceError, match="us-central1-a"):
        load_skynomad_h100(root / "skynomad" / "h100_16_probe_counts.csv", "mars-north1-a")


@pytest.mark.parametrize(
    ("segment", "initial", "removes", "minutes"), [("0203", 9, 3, 12), ("0304", 7, 3, 22), ("0506", 10, 3, 17)]
)
def test_spotserve_segments(root, segment, initial, removes, minutes):
    trace = load_trace(f"spotserve/{segment}", root)
    assert trace.initial == initial
    assert summarize(trace).preemptions == removes
    assert trace.duration_s == minutes * 60


def test_trace_references_and_directory_override(tmp_path, monkeypatch):
    (tmp_path / "bamboo" / "traces").mkdir(parents=True)
    (tmp_path / "bamboo" / "traces" / "tiny-trace.csv").write_text("0,add,a\n0,add,b\n5000,remove,a\n9000,add,c\n")
    monkeypatch.setenv("RLBOOST_TRACES_DIR", str(tmp_path))
    trace = load_trace("bamboo/tiny")
    assert trace.steps == ((0.0, 2), (5.0, 1), (9.0, 2))
    assert [e.t for e in trace.preemptions] == [5.0]
    with pytest.raises(TraceError, match="not found.*RLBOOST_TRACES_DIR"):
        load_trace("bamboo/missing")
    with pytest.raises(TraceError, match="unknown trace 'aws/p5'"):
        load_trace("aws/p5")


# -- bad rows -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("0,add,a\n1000,add,b\n2000,launch,c\n", 3, "add|remove"),
        ("0,add,a\nsoon,add,b\n", 2, "not a number"),
        ("0,add,a\n1000,remove,b\n", 2, "removed while not alive"),
        ("0,add,a\n5000,add,b\n4000,remove,a\n", 3, "goes backwards"),
        ("0,add,a\n1000,add,a\n", 2, "added while alive"),
    ],
)
def test_bad_bamboo_rows_name_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "bad-trace.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=rf"bad-trace\.csv:{line}: .*{re.escape(message)}"):
        load_bamboo(path)


def test_bad_rows_of_the_other_formats(tmp_path):
    spot = tmp_path / "seg.txt"
    spot.write_text('[0, "add", {"nodes": ["n0"]}]\n[60000, "remove", {"nodez": ["n0"]}]\n')
    with pytest.raises(TraceError, match=r"seg\.txt:2: "):
        load_spotserve(spot)
    log = tmp_path / "pool.txt"
    log.write_text("2021-12-11, 11:11:30, 55\n2021-12-11, 11:13:10, many\n")
    with pytest.raises(TraceError, match=r"pool\.txt:2: "):
        load_gcloud_log(log)
    probes = tmp_path / "probes.csv"
    probes.write_text(
        "scheduled_at_utc,zone,instances_requested,instances_created\n"
        "2025-10-04T00:10:00Z,z-a,16,3\n2025-10-04T00:20:00Z,z-a,16,17\n"
    )
    with pytest.raises(TraceError, match=r"probes\.csv:3: instances_created 17"):
        load_skynomad_h100(probes, "z-a")
    probes.write_text("when,zone\n")
    with pytest.raises(TraceError, match=r"probes\.csv:1: missing columns"):
        load_skynomad_h100(probes, "z-a")


def test_count_samples_become_events(tmp_path):
    log = tmp_path / "pool.txt"
    # Out of order, as the real logs are; the later of two lines for one timestamp wins.
    lines = ["2021-12-11, 11:20:00, 4", "2021-12-11, 11:00:00, 5", "2021-12-11, 11:10:00, 2", "2021-12-11, 11:10:00, 3"]
    log.write_text("\n".join(lines) + "\n")
    trace = load_gcloud_log(log)
    assert trace.steps == ((0.0, 5), (600.0, 3), (1200.0, 4))
    assert trace.preemptions == (TraceEvent(600.0, -2),)
    assert trace.duration_s == 1200.0


# -- schedules ----------------------------------------------------------------------------------


def _scripted() -> AvailabilityTrace:
    """4 slots: 4 until t=100, 2 until t=200, 4 until the end at t=300."""
    return AvailabilityTrace("scripted", 4, 4, (TraceEvent(100.0, -2), TraceEvent(200.0, 2)), 300.0)


def test_compression_offset_and_scaling():
    schedule = TraceSchedule(_scripted(), max_size=2, time_compression=10.0, offset_s=50.0)
    assert schedule.trace_time(5.0) == 100.0
    # wall 0 -> trace 50 (4 of 4 -> 2 of 2); wall 5 -> trace 100 (2 of 4 -> 1 of 2); wall 15 -> 200.
    assert [schedule.capacity_at(t) for t in (0.0, 4.9, 5.0, 14.9, 15.0)] == [2, 2, 1, 1, 2]
    assert schedule.events_between(0.0, 30.0) == [CapacityChange(5.0, 1, -1), CapacityChange(15.0, 2, 1)]
    # Looping: trace 400 = 100 of the second pass, at wall (400 - 50) / 10 = 35.
    assert schedule.events_between(30.0, 40.0) == [CapacityChange(35.0, 1, -1)]
    assert schedule.capacity_at(36.0) == 1
    with pytest.raises(ValueError, match="wall time"):
        schedule.capacity_at(-1.0)


def test_loop_wraps_to_the_initial_capacity_and_no_loop_holds_the_last():
    trace = AvailabilityTrace("ramp", 3, 0, (TraceEvent(10.0, 3),), 20.0)
    looping = TraceSchedule(trace, 3, time_compression=2.0)
    assert [looping.capacity_at(t) for t in (0.0, 5.0, 9.9, 10.0, 15.0)] == [0, 3, 3, 0, 3]
    assert looping.events_between(0.0, 15.0) == [
        CapacityChange(5.0, 3, 3),
        CapacityChange(10.0, 0, -3),
        CapacityChange(15.0, 3, 3),
    ]
    held = TraceSchedule(trace, 3, time_compression=2.0, loop=False)
    assert held.capacity_at(100.0) == 3 and held.events_between(6.0, 100.0) == []


def test_trace_invariants():
    with pytest.raises(ValueError, match="outside"):
        AvailabilityTrace("over", 2, 2, (TraceEvent(1.0, 1),), 10.0)
    with pytest.raises(ValueError, match="out of order"):
        AvailabilityTrace("unsorted", 4, 2, (TraceEvent(5.0, 1), TraceEvent(1.0, -1)), 10.0)


# -- Poisson model ------------------------------------------------------------------------------


def test_poisson_is_deterministic_by_seed():
    a = PoissonLifetimes(600.0, 120.0, seed=7).trace(4, 10 * HOUR)
    assert a == PoissonLifetimes(600.0, 120.0, seed=7).trace(4, 10 * HOUR)
    assert a != PoissonLifetimes(600.0, 120.0, seed=8).trace(4, 10 * HOUR)
    assert a.initial == 4 and all(0 <= cap <= 4 for cap in _capacities(a))


def test_poisson_lifetimes_and_gaps_match_the_means():
    summary = summarize(PoissonLifetimes(600.0, 200.0, seed=1).trace(8, 2000 * 800.0))
    assert summary.mean_lifetime_s == pytest.approx(600.0, rel=0.05)
    assert summary.mean_gap_s == pytest.approx(200.0, rel=0.05)
    assert summary.mean_capacity == pytest.approx(8 * 600 / 800, rel=0.05)
    assert summary.preemptions_per_hour == pytest.approx(8 * HOUR / 800, rel=0.05)


def test_summary_calibrates_a_poisson_model():
    summary = summarize(_scripted())
    assert summary.preemptions == 2 and summary.mean_capacity == pytest.approx(4 * 2 / 3 + 2 / 3)
    assert summary.mean_lifetime_s == pytest.approx((4 * 300 - 2 * 100) / 2)
    assert summary.mean_gap_s == pytest.approx(2 * 100 / 2)
    model = summary.poisson(seed=3)
    assert (model.mean_life_s, model.mean_gap_s, model.seed) == (500.0, 100.0, 3)
    assert summarize(AvailabilityTrace("flat", 1, 1, (), 10.0)).mean_lifetime_s == math.inf
    with pytest.raises(ValueError, match="positive"):
        PoissonLifetimes(0.0, 1.0)
