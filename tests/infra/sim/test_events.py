"""The event loop runs callbacks in time order, same-time events in scheduling order."""

from __future__ import annotations

import pytest

from infra.sim.events import EventLoop


def test_events_run_in_time_order_and_ties_in_scheduling_order():
    loop, seen = EventLoop(), []
    loop.at(2.0, lambda: seen.append(("b", loop.now)))
    loop.at(1.0, lambda: seen.append(("a", loop.now)))
    loop.at(2.0, lambda: seen.append(("c", loop.now)))
    loop.at(1.0, lambda: loop.after(0.5, lambda: seen.append(("d", loop.now))))
    loop.run(until=lambda: False)
    assert seen == [("a", 1.0), ("d", 1.5), ("b", 2.0), ("c", 2.0)]


def test_run_stops_when_the_condition_holds():
    loop, seen = EventLoop(), []
    for t in range(5):
        loop.at(float(t), lambda t=t: seen.append(t))
    loop.run(until=lambda: len(seen) == 3)
    assert seen == [0, 1, 2] and loop.now == 2.0


def test_the_past_cannot_be_scheduled():
    loop = EventLoop()
    loop.at(5.0, lambda: None)
    loop.run(until=lambda: False)
    with pytest.raises(ValueError, match="before now"):
        loop.at(4.0, lambda: None)
