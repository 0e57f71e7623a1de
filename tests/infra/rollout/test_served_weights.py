"""Which weights each instance serves: the token log refuses a claim or a flush whose weights sha
differs from the publisher's for its version, and a worker that serves tampered bytes after a
verified pull (its engine perturbs what it loaded) gets no sample, while an honest one does the
step; its heartbeat shows the wrong sha and the fleet view counts it."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping

import pytest
import redis
import torch

from infra.rollout.instance import InstanceSpec
from infra.rollout.protocol import set_current_step
from infra.rollout.registry import InstanceRegistry, InstanceSnapshot
from infra.rollout.served import served_weights
from infra.rollout.tokenlog import Flush, GroupSpec, TokenLog
from infra.rollout.worker import RolloutWorker, WorkerConfig
from infra.weights.config import WeightsConfig
from infra.weights.manifest import fingerprint
from infra.weights.publisher import WeightPublisher
from infra.weights.shared import share_config
from tests.fakes.engine import ScriptedEngine, scripted_response
from tests.helpers import wait_for

LENGTH = 6


def _snapshot(instance_id: str, version: int | None, sha: str | None) -> InstanceSnapshot:
    spec = InstanceSpec(instance_id=instance_id, pool="local-spot")
    return InstanceSnapshot(spec, 2, True, 0.0, 1.0, version, 2, 0, weights_sha=sha)


def test_served_weights_counts_versions_and_wrong_bytes() -> None:
    expected = {0: "a0", 1: "a1"}
    fleet = [
        _snapshot("a", 1, "a1"),
        _snapshot("b", 1, "bad"),
        _snapshot("c", 0, None),  # the base model it started on: no sha, not judged
        _snapshot("d", None, None),
        _snapshot("e", 2, "x"),  # a version the publisher has not recorded: not judged
    ]
    served = served_weights(fleet, expected)
    assert served.versions == {"none": 1, "0": 1, "1": 2, "2": 1}
    assert served.wrong == ("b",)


@pytest.mark.integration
def test_the_token_log_refuses_claims_and_flushes_with_another_sha(redis_client) -> None:
    log = TokenLog(redis_client, f"sha-{uuid.uuid4().hex[:8]}")
    log.enqueue_step(1, 1, [GroupSpec(0, [1, 2], 2, LENGTH, seed=1, sampling={})])
    log.expect_weights(1, "good")
    assert log.expected_weights() == {1: "good"}
    assert log.claim(1, "bad", 1, 2, weights_sha="other") == []
    claims = log.claim(1, "ok", 1, 2, weights_sha="good")
    assert len(claims) == 2
    first, second = claims
    tokens = scripted_response(first.sample_id, 2)
    assert log.log([Flush(first.sample_id, "ok", first.epoch, tokens, [-1.0, -1.0], 0, weights_sha="good")]) == [True]
    # the same instance, now decoding with other bytes: refused (a strict flush: the step's version)
    assert log.log([Flush(second.sample_id, "ok", second.epoch, tokens, [-1.0, -1.0], 0, weights_sha="x")]) == [False]
    assert log.log(
        [Flush(second.sample_id, "ok", second.epoch, tokens, [-1.0, -1.0], 0, policy_version=1, weights_sha="x")]
    ) == [False]
    stats = log.stats()
    assert stats.wrong_weights == 3 and stats.rejected_appends == 2
    assert log.step_status(1).tokens_logged == 2


class TamperingEngine(ScriptedEngine):
    """Perturbs the weights it was handed after the pull verified them (a buggy in-place load)."""

    def load_weights(self, state_dict: Mapping, version: int) -> None:
        for tensor in state_dict.values():
            tensor.add_(1.0)
        super().load_weights(state_dict, version)


def _worker(redis_url: str, run_id: str, name: str, engine: ScriptedEngine) -> RolloutWorker:
    config = WorkerConfig(
        redis_url=redis_url,
        run_id=run_id,
        instance=InstanceSpec(instance_id=name, pool="local-spot"),
        model_path="(scripted engine)",
        slots=4,
        flush_tokens=2,
        flush_ms=5,
        heartbeat_s=0.1,
        ttl_s=10,
        poll_ms=10,
    )
    return RolloutWorker(config, client=redis.Redis.from_url(redis_url), engine=engine)


@pytest.mark.integration
def test_an_instance_serving_tampered_weights_is_refused_and_counted(redis_url, tmp_path) -> None:
    client = redis.Redis.from_url(redis_url)
    run_id = f"tamper-{uuid.uuid4().hex[:8]}"
    log = TokenLog(client, run_id)
    settings = WeightsConfig.model_validate({})
    os.environ.setdefault(settings.secret_env, uuid.uuid4().hex)
    share_config(client, run_id, settings, tmp_path)
    publisher = WeightPublisher(settings, client, run_id, run_dir=tmp_path, on_published=log.expect_weights)
    state = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8)}
    honest, tampered = ScriptedEngine(lambda _: LENGTH), TamperingEngine(lambda _: LENGTH)
    workers = [_worker(redis_url, run_id, "honest", honest), _worker(redis_url, run_id, "tampered", tampered)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    try:
        publisher.publish(1, state)
        publisher.flush()
        assert log.expected_weights() == {1: fingerprint(state)}
        # the tampered worker first, alone: it pulls version 1 (verified), perturbs it, and is refused
        log.enqueue_step(1, 1, [GroupSpec(g, [1, 2, 3], 2, LENGTH, seed=g, sampling={}) for g in range(3)])
        set_current_step(client, run_id, 1, 1)
        threads[1].start()
        wait_for(lambda: log.stats().wrong_weights > 0, "the tampered worker's claim refused")
        threads[0].start()
        wait_for(lambda: log.step_status(1).complete, "the step done by the honest worker")
        registry = InstanceRegistry(client, run_id)
        wait_for(lambda: all(s.weights_sha for s in registry.alive()) and len(registry.alive()) == 2, "heartbeats")
        served = served_weights(registry.alive(), log.expected_weights())
    finally:
        for worker in workers:
            worker.request_stop("test over")
        for thread in threads:
            if thread.is_alive():
                thread.join(timeout=10)
        publisher.close()
    assert tampered.policy_version == 1 and tampered.requests == []  # loaded, never given a sample
    assert workers[1].weights_sha != fingerprint(state) and workers[0].weights_sha == fingerprint(state)
    assert served.versions == {"1": 2} and served.wrong == ("tampered",)
    owners = {r.sample_id for r in honest.requests}
    records = [r for g in range(3) for r in log.read_group(1, g)]
    assert len(records) == 6 and {r.sample_id for r in records} == owners  # every trained token is the honest one's
    assert all(r.token_ids == scripted_response(r.sample_id, LENGTH) for r in records)
