"""Spot capacity for the simulator from the real shipped traces, the paper's schedule and a constant pool."""

from __future__ import annotations

from infra.sim.availability import capacity_changes, paper_trace, spot_schedule
from infra.sim.scenario import parse_scenario


def schedule_of(yaml_text: str):
    return spot_schedule(parse_scenario(yaml_text))


def test_skynomad_h100_probes_scale_to_the_pool_and_change_over_a_day():
    schedule = schedule_of("spot:\n  max_instances: 4\navailability:\n  trace: skynomad/h100/us-central1-b\n")
    changes = capacity_changes(schedule, 24 * 3600)
    assert changes and all(0 <= c.capacity <= 4 for c in changes)
    assert any(c.delta < 0 for c in changes) and any(c.delta > 0 for c in changes)
    assert [c.t for c in changes] == sorted(c.t for c in changes)


def test_bamboo_p3_events_scale_and_loop_past_the_traces_end():
    schedule = schedule_of("spot:\n  max_instances: 8\navailability:\n  trace: bamboo/p3\n")
    duration = schedule.trace.duration_s
    assert 0 < schedule.capacity_at(0) <= 8
    late = capacity_changes(schedule, 2 * duration)
    assert any(c.t > duration for c in late)  # looped


def test_spotserve_segment_loads():
    schedule = schedule_of("spot:\n  max_instances: 4\navailability:\n  trace: spotserve/0304\n")
    assert capacity_changes(schedule, schedule.trace.duration_s)


def test_paper_schedule_adds_every_interval_then_cycles_one_instance():
    trace = paper_trace(4, 1800, 6 * 3600)
    capacity = [trace.capacity_at(t) for t in (0, 1800, 3600, 5400, 7200, 9000, 10800, 12600)]
    assert capacity == [0, 1, 2, 3, 4, 3, 4, 3]
    assert paper_trace(0, 1800, 3600).capacity_at(3000) == 0


def test_constant_pool_is_full_and_never_changes():
    schedule = schedule_of("spot:\n  max_instances: 3\navailability:\n  source: constant\n")
    assert schedule.capacity_at(0) == 3 and capacity_changes(schedule, 10 * 3600) == []
