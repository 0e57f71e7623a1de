"""Spot capacity over simulated time, from the scenario's `availability` section.

Every source becomes an `infra.availability.traces.TraceSchedule` for a pool of
`spot.max_instances` (the runtime's own replay: a recorded trace's capacity is scaled to the pool
and looped), so the simulator reads only `capacity_at` and `events_between`:

* `trace`: a recorded trace (`load_trace`), e.g. SkyNomad's H100 probes of one zone (16 VMs per
  round, scaled to the pool), Bamboo's p3 add/remove events or a SpotServe segment;
* `paper`: the RLBoost artifact's schedule, one instance added every `add_every_s` up to the pool
  size, then one killed and another added `add_every_s` later, over and over;
* `constant`: the pool full, never preempted (the paper-table rows).
"""

from __future__ import annotations

from infra.availability.traces import AvailabilityTrace, CapacityChange, TraceEvent, TraceSchedule, load_trace
from infra.sim.scenario import Scenario


def paper_trace(max_instances: int, every_s: float, duration_s: float) -> AvailabilityTrace:
    """Empty at 0; +1 every `every_s` up to `max_instances`; then -1 and, `every_s` later, +1, repeated."""
    events: list[TraceEvent] = []
    if max_instances == 0:
        return AvailabilityTrace("paper", 1, 0, (), duration_s)
    t = every_s
    for _ in range(max_instances):
        if t > duration_s:
            break
        events.append(TraceEvent(t, 1))
        t += every_s
    while t + every_s <= duration_s:
        events += [TraceEvent(t, -1), TraceEvent(t + every_s, 1)]
        t += 2 * every_s
    return AvailabilityTrace("paper", max_instances, 0, tuple(events), duration_s)


def spot_schedule(scenario: Scenario) -> TraceSchedule:
    """The spot pool's capacity timeline for `scenario`."""
    availability, size = scenario.availability, scenario.spot.max_instances
    duration = scenario.run.duration_s
    if availability.source == "trace":
        trace = load_trace(availability.trace or "")
        return TraceSchedule(trace, size, availability.time_compression, availability.offset_s)
    if availability.source == "paper":
        return TraceSchedule(paper_trace(size, availability.add_every_s, duration), size, loop=False)
    constant = AvailabilityTrace("constant", max(size, 1), max(size, 1), (), duration)
    return TraceSchedule(constant, size, loop=False)


def capacity_changes(schedule: TraceSchedule, horizon_s: float) -> list[CapacityChange]:
    """Every capacity change in `(0, horizon_s]`, in order."""
    return schedule.events_between(0.0, horizon_s)
