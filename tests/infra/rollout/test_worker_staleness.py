"""A rollout worker under bounded staleness, in process against a real redis-server: it picks up
each new version as it is published, between flushes, and a response in progress continues on
the new weights (partial rollout) under the same lease, each chunk logged with its version."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from infra.rollout.direct_weights import DirectWeights
from infra.rollout.instance import InstanceSpec
from infra.rollout.protocol import set_current_step
from infra.rollout.tokenlog import GroupSpec, TokenLog
from infra.rollout.worker import RolloutWorker, WorkerConfig
from tests.fakes.engine import ScriptedEngine, scripted_response
from tests.helpers import wait_for

pytestmark = pytest.mark.integration

LENGTH = 40
"""Response tokens of each sample: long enough to see two new versions arrive mid-response."""


def _worker(redis_url: str, run_id: str, engine: ScriptedEngine, weights: DirectWeights) -> RolloutWorker:
    config = WorkerConfig(
        redis_url=redis_url,
        run_id=run_id,
        instance=InstanceSpec(instance_id="w", pool="local-spot"),
        model_path="(scripted engine)",
        slots=2,
        flush_tokens=2,
        flush_ms=5,
        heartbeat_s=0.1,
        ttl_s=10,
        poll_ms=10,
    )
    return RolloutWorker(config, client=redis.Redis.from_url(redis_url), engine=engine, weights=weights)


def test_a_response_in_progress_continues_on_each_new_version(redis_url):
    client = redis.Redis.from_url(redis_url)
    run_id = f"stale-{uuid.uuid4().hex[:8]}"
    log = TokenLog(client, run_id)
    engine = ScriptedEngine(lambda sample_id: LENGTH, step_s=0.01)
    weights = DirectWeights()
    weights.offer(0, {})
    # Step 3 trains from version 2; with K = 2 its tokens may come from versions 0, 1 and 2.
    spec = GroupSpec(0, [1, 2, 3], 2, LENGTH, seed=1, sampling={"temperature": 1.0})
    log.enqueue_step(3, 2, [spec], min_version=0)
    set_current_step(client, run_id, 3, 0, first=3, staleness=2)
    worker = _worker(redis_url, run_id, engine, weights)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        for version, logged in ((1, 8), (2, 20)):
            wait_for(lambda: log.step_status(3).tokens_logged >= 2 * logged, f"{logged} tokens per sample")
            weights.offer(version, {})
            wait_for(lambda: engine.policy_version == version, f"version {version} loaded")
        wait_for(lambda: log.step_status(3).complete, "the step", timeout_s=30)
    finally:
        worker.request_stop("test over")
        thread.join(timeout=10)
    for record in log.read_group(3, 0):
        assert record.token_ids == scripted_response(record.sample_id, LENGTH)  # continued, never restarted
        versions = record.token_versions()
        assert [v for v, _ in record.version_spans] == sorted({v for v, _ in record.version_spans})
        assert versions[0] == 0 and versions[-1] == 2 and sorted(set(versions)) == [0, 1, 2]
        assert (record.attempts, record.migrations) == (1, 0)  # the same lease throughout
    resumed = [r for r in engine.requests if r.generated_ids]
    assert len(resumed) >= 4  # each sample re-added on versions 1 and 2 with its logged prefix
    assert all(r.generated_ids == scripted_response(r.sample_id, len(r.generated_ids)) for r in resumed)
    assert worker.stats.weight_loads == 2 and worker.stats.released == 0


def test_a_strict_worker_claims_only_with_the_steps_version(redis_url):
    client = redis.Redis.from_url(redis_url)
    run_id = f"strict-{uuid.uuid4().hex[:8]}"
    log = TokenLog(client, run_id)
    engine = ScriptedEngine(lambda sample_id: 4)
    weights = DirectWeights()
    weights.offer(0, {})
    log.enqueue_step(2, 1, [GroupSpec(0, [1, 2], 2, 4, seed=1, sampling={"temperature": 1.0})])
    set_current_step(client, run_id, 2, 1)
    worker = _worker(redis_url, run_id, engine, weights)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        # The registry's view, not worker.heartbeat(): called before the worker registers, that
        # answers False and stops the worker as evicted.
        wait_for(lambda: worker.registry.alive() and engine.policy_version == 0, "the worker running")
        assert log.step_status(2).running == 0  # version 0 is not step 2's
        weights.offer(1, {})
        wait_for(lambda: log.step_status(2).complete, "the step")
    finally:
        worker.request_stop("test over")
        thread.join(timeout=10)
    assert all(r.version_spans == () and set(r.token_versions()) == {1} for r in log.read_group(2, 0))
