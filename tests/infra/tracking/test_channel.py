"""`Channel`: `put` never waits for the tracker; what is put within `interval_s` of a send goes in
the next, which the run's end does not wait for; a tracker that fails keeps its entries, in order,
until it comes back; a full buffer and what is left at `close` are dropped and counted."""

from __future__ import annotations

import threading
import time

from infra.tracking.channel import Channel, Metrics
from tests.helpers import wait_for


class Tracker:
    """A tracker whose server is up or down (`down`), recording what reached it."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.received: list[int] = []
        self.batches: list[list[int]] = []

    def send(self, ops) -> None:
        if self.down.is_set():
            raise ConnectionError("server gone")
        self.received += [op.step for op in ops]
        self.batches.append([op.step for op in ops])


def test_what_is_put_within_the_interval_goes_in_one_send():
    tracker = Tracker()
    channel = Channel("t", tracker.send, interval_s=0.5)
    sent_at = time.monotonic()
    channel.put(Metrics(1, {"x": 1.0}))
    wait_for(lambda: tracker.batches == [[1]], "step 1 sent at once")
    for step in (2, 3, 4):
        channel.put(Metrics(step, {"x": 1.0}))
    wait_for(lambda: len(tracker.batches) == 2, "the next send")
    assert time.monotonic() - sent_at >= 0.5 and tracker.batches == [[1], [2, 3, 4]]
    channel.close(1)


def test_the_runs_end_does_not_wait_for_the_interval():
    tracker = Tracker()
    channel = Channel("t", tracker.send, interval_s=600)
    channel.put(Metrics(1, {"x": 1.0}))
    wait_for(lambda: tracker.batches == [[1]], "step 1 sent at once")
    channel.put(Metrics(2, {"x": 1.0}))
    started = time.monotonic()
    channel.flush(300)
    assert tracker.batches == [[1], [2]] and time.monotonic() - started < 300
    channel.put(Metrics(3, {"x": 1.0}))
    channel.close(300)
    assert tracker.batches[-1] == [3] and channel.dropped == 0


def test_entries_wait_for_a_failing_tracker_and_arrive_in_order(caplog):
    tracker = Tracker()
    channel = Channel("t", tracker.send, retry_s=0.05, interval_s=0.0)
    channel.put(Metrics(1, {"x": 1.0}))
    wait_for(lambda: tracker.received == [1], "step 1 sent")
    tracker.down.set()
    started = time.perf_counter()
    for step in range(2, 6):
        channel.put(Metrics(step, {"x": 1.0}))
    assert time.perf_counter() - started < 0.05  # the caller never waits for the tracker
    wait_for(lambda: channel.failing, "the failure noticed")
    tracker.down.clear()
    channel.flush(10)
    assert tracker.received == [1, 2, 3, 4, 5] and channel.dropped == 0
    channel.close(1)
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1  # one warning per outage, however many retries


def test_a_full_buffer_and_the_rest_at_close_are_dropped_and_counted():
    tracker = Tracker()
    tracker.down.set()
    channel = Channel("t", tracker.send, capacity=3, retry_s=0.05)
    for step in range(5):
        channel.put(Metrics(step, {"x": 1.0}))
    assert channel.dropped == 2  # the buffer held 3
    channel.close(0.2)
    assert channel.dropped == 5 and tracker.received == []
    channel.put(Metrics(9, {"x": 1.0}))  # after close: dropped, no error
    assert channel.dropped == 6
