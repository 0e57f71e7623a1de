"""The pipelined flush: ordered batches, callbacks on the caller's thread, errors leave state alone."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from infra.rollout.flush_pipeline import FlushPipeline
from infra.rollout.tokenlog import Flush, GroupSpec, TokenLog

pytestmark = pytest.mark.integration


@pytest.fixture
def leased(redis_client):
    """A token log with one group of two samples leased to instance `a`."""
    log = TokenLog(redis_client, f"flush-{uuid.uuid4().hex[:8]}")
    log.enqueue_step(0, 0, [GroupSpec(0, [1, 2], 2, 8)])
    claims = {c.sample_id: c for c in log.claim(0, "a", 0, 2)}
    return log, claims


def test_batches_apply_in_order_and_callbacks_run_on_the_caller_thread(leased):
    log, claims = leased
    pipeline = FlushPipeline(log)
    seen: list[tuple[int, list[bool], str]] = []
    for batch, offset in enumerate((0, 2, 4)):
        flushes = [
            Flush(sid, "a", c.epoch, [10 + batch, 20 + batch], [-0.5, -0.25], offset) for sid, c in claims.items()
        ]
        pipeline.submit(flushes, lambda results, b=batch: seen.append((b, results, threading.current_thread().name)))
        assert pipeline.busy
    pipeline.settle()
    assert not pipeline.busy
    caller = threading.current_thread().name
    assert seen == [(b, [True, True], caller) for b in range(3)]
    (record, *_rest) = log.read_group(0, 0)
    assert record.token_ids == [10, 20, 11, 21, 12, 22]
    pipeline.close()


def test_a_revoked_lease_is_reported_as_rejected(leased):
    log, claims = leased
    sid, claim = next(iter(claims.items()))
    pipeline = FlushPipeline(log)
    results: list[list[bool]] = []
    pipeline.submit([Flush(sid, "a", claim.epoch + 1, [7], [-1.0], 0)], results.append)
    pipeline.settle()
    assert results == [[False]]
    pipeline.close()


def test_a_failed_round_trip_reraises_and_never_runs_the_callback():
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    pipeline = FlushPipeline(TokenLog(dead, "nowhere"))
    called: list[list[bool]] = []
    pipeline.submit([Flush("0/0/0", "a", 1, [1], [-1.0], 0)], called.append)
    with pytest.raises(redis.ConnectionError):
        pipeline.settle()
    assert called == [] and not pipeline.busy
    pipeline.settle()  # nothing left in flight
    pipeline.close()
