"""Environment segments in the token log, against a real redis-server (one shard, three) and a real
Redis Cluster: env flushes log their tokens with logprob 0.0 and version `ENV_VERSION`, skip the
staleness check (model flushes do not), record their turn once however often they are
redelivered, are fenced like any flush, and give the loss mask; infrastructure failures count by
kind, and `renormalize` completes a group without them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from infra.rollout.controller import samples_of_group
from infra.rollout.tokenlog import (
    ENV_VERSION,
    EnvironmentSpec,
    Flush,
    GroupSpec,
    LoggedTurn,
    Outcome,
    TokenLog,
)
from infra.services.redis_embedded import RedisSettings

pytestmark = pytest.mark.integration

SAMPLING = {"temperature": 1.0}
ENV = EnvironmentSpec("rl.environments.calculator:Calculator", prompt="417*36=", answer="15012", max_turns=3)


@pytest.fixture(params=["one-shard", "three-shards", "cluster"])
def log(request) -> Iterator[TokenLog]:
    if request.param == "cluster":
        url, shards = request.getfixturevalue("redis_cluster_url"), 6
    else:
        url, shards = request.getfixturevalue("redis_url"), 1 if request.param == "one-shard" else 3
    client = RedisSettings(url=url).client()
    yield TokenLog(client, f"env-{uuid.uuid4().hex[:8]}", shards=shards)
    client.close()


def group(group_id: int = 0, n: int = 1, max_new: int = 32, **kwargs) -> GroupSpec:
    return GroupSpec(group_id, [1, 2, 3], n, max_new, seed=7, sampling=SAMPLING, environment=ENV, **kwargs)


def model(claim, tokens, offset, version=None, finish=None, outcome=None, instance="a") -> Flush:
    return Flush(
        claim.sample_id,
        instance,
        claim.epoch,
        tokens,
        [-0.25 * (t % 4 + 1) for t in tokens],
        offset,
        finish,
        version,
        outcome=outcome,
    )


def env(claim, tokens, offset, turn, observation, instance="a") -> Flush:
    return Flush(
        claim.sample_id,
        instance,
        claim.epoch,
        tokens,
        [0.0] * len(tokens),
        offset,
        source="env",
        observation=observation,
        turn=turn,
    )


def test_a_trajectory_logs_model_and_env_segments_and_derives_its_loss_mask(log):
    assert log.enqueue_step(0, 4, [group()])
    (claim,) = log.claim(0, "a", 4, 1)
    assert claim.environment == ENV and claim.turns == () and claim.turn_start == 0
    assert log.log([model(claim, [10, 11, 12], 0)]) == [True]
    assert log.log([env(claim, [20, 21], 3, 0, "15012")]) == [True]
    assert log.log([model(claim, [13, 14], 5)]) == [True]
    assert log.log([model(claim, [], 7, finish="stop", outcome=Outcome(reward=1.0))]) == [True]
    (record,) = log.read_group(0, 0)
    assert record.state == "done" and record.token_ids == [10, 11, 12, 20, 21, 13, 14]
    assert record.logprobs[3:5] == [0.0, 0.0]
    # Strictly on-policy, model flushes carry no version: the step's, also after an env segment.
    assert record.version_spans == ((3, ENV_VERSION), (5, 4))
    assert record.token_versions() == [4, 4, 4, ENV_VERSION, ENV_VERSION, 4, 4]
    assert record.loss_mask() == [1, 1, 1, 0, 0, 1, 1]
    assert record.turns == (LoggedTurn(3, "15012"),)
    assert record.outcome == Outcome(reward=1.0, truncated=False)
    (sample,) = samples_of_group([record])
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1, 1] and sample.token_versions == []
    assert sample.env_reward == 1.0 and sample.model_turns() == [(0, 3, "15012"), (5, 7, None)]


def test_env_flushes_skip_the_staleness_check_and_model_flushes_do_not(log):
    log.enqueue_step(0, 3, [group()], min_version=2)
    (claim,) = log.claim(0, "a", 3, 1)
    assert log.log([model(claim, [10], 0, version=1)]) == [False]  # below the window
    assert log.log([model(claim, [10], 0, version=2)]) == [True]
    assert log.log([env(claim, [20], 1, 0, "x")]) == [True]  # env tokens have no policy version
    assert log.log([model(claim, [11], 2, version=1)]) == [False]  # still refused after a segment
    assert log.log([model(claim, [11], 2, version=3)]) == [True]
    (record,) = log.read_group(0, 0)
    assert record.version_spans == ((0, 2), (1, ENV_VERSION), (2, 3))
    with pytest.raises(ValueError, match="an env flush has"):
        log.log([Flush(claim.sample_id, "a", claim.epoch, [1], [-1.0], 3, source="env", turn=1)])
    with pytest.raises(ValueError, match="source"):
        log.log([Flush(claim.sample_id, "a", claim.epoch, [1], [-1.0], 3, source="tool")])


def test_env_flushes_are_fenced_and_their_turn_is_recorded_once(log):
    log.enqueue_step(0, 0, [group()])
    (claim,) = log.claim(0, "a", 0, 1)
    assert log.log([model(claim, [10, 11], 0)]) == [True]
    first = env(claim, [20, 21], 2, 0, "3")
    assert log.log([first, first]) == [True, True]  # a redelivery: applied once
    assert log.log([env(claim, [], 4, 1, None), env(claim, [], 4, 1, None)]) == [True, True]
    assert log.log([env(claim, [22], 2, 0, "3")]) == [False]  # not where the log ends
    assert log.log([env(claim, [22], 4, 2, "y", instance="b")]) == [False]  # not the owner
    (record,) = log.read_group(0, 0)
    assert record.token_ids == [10, 11, 20, 21] and record.turns == (LoggedTurn(2, "3"), LoggedTurn(4, None))
    assert log.reap("a", 3) == 1
    assert log.log([env(claim, [22], 4, 2, "z")]) == [False]  # a zombie after the reap
    (moved,) = log.claim(0, "b", 0, 1)
    assert moved.generated_ids == [10, 11, 20, 21] and moved.version_spans == ((2, ENV_VERSION),)
    assert moved.turns == (LoggedTurn(2, "3"), LoggedTurn(4, None)) and moved.turn_start == 4
    assert moved.request().turn_start == 4
    assert log.release(moved.sample_id, "b", moved.epoch, keep_tokens=False, env_retry=True)
    (fresh,) = log.claim(0, "c", 0, 1)
    assert (fresh.generated_ids, fresh.version_spans, fresh.turns, fresh.env_retries) == ([], (), (), 1)
    assert log.stats().rejected_appends == 3


def _finish(log: TokenLog, claim, instance: str = "a") -> bool:
    return log.log([model(claim, [5], 0, finish="stop", instance=instance)]) == [True]


def test_infra_failures_count_by_kind_and_renormalize_completes_the_group_without_them(log):
    specs = [
        group(0, n=3, infra_failed="renormalize"),
        group(1, n=2),  # drop_group
        group(2, n=2, infra_failed="renormalize"),  # a failure that is not the infrastructure's
        group(3, n=1, infra_failed="renormalize"),  # nothing left to train
    ]
    log.enqueue_step(0, 0, specs)
    claims = {c.sample_id: c for c in log.claim(0, "a", 0, 8)}
    assert log.fail("0/0/1", "a", claims["0/0/1"].epoch, "infra:env_error")
    assert _finish(log, claims["0/0/0"]) and _finish(log, claims["0/0/2"])
    assert log.fail("0/1/0", "a", claims["0/1/0"].epoch, "infra:env_timeout")
    assert _finish(log, claims["0/1/1"])
    assert log.fail("0/2/0", "a", claims["0/2/0"].epoch, "engine: too long")
    assert _finish(log, claims["0/2/1"])
    assert log.fail("0/3/0", "a", claims["0/3/0"].epoch, "infra:env_timeout")
    status = log.step_status(0)
    assert (status.groups_done, status.dropped_group_ids) == (1, (1, 2, 3))
    assert status.infra_failed == {"env_error": 1, "env_timeout": 2}
    assert log.next_completed_groups(0) == [0]
    samples = samples_of_group(log.read_group(0, 0))
    assert [s.sample_id for s in samples] == ["0/0/0", "0/0/2"]
    with pytest.raises(ValueError, match="0/2/0 is failed"):
        samples_of_group(log.read_group(0, 2))
    with pytest.raises(ValueError, match="infra_failed"):
        group(4, infra_failed="keep")


def test_env_seconds_waits_and_mid_turn_migrations_are_recorded_once(log):
    single = GroupSpec(1, [1, 2, 3], 1, 32, seed=7, sampling=SAMPLING)
    log.enqueue_step(0, 0, [group(n=2), single])
    claims = log.claim(0, "a", 0, 3)
    for claim in claims:
        assert log.log([model(claim, [10, 11], 0)]) == [True]
    for claim in claims[:2]:
        answer = env(claim, [20], 2, 0, "3")._replace(env_s=0.25, wait_s=0.5)
        assert log.log([answer, answer]) == [True, True]  # a redelivery adds nothing
    assert log.log([model(claims[0], [12], 3)]) == [True]  # the first is inside its second turn
    for claim in claims:  # the second is at a turn boundary; the third is not a trajectory
        assert log.release(claim.sample_id, "a", claim.epoch)
    for claim in log.claim(0, "b", 0, 3):
        offset = len(claim.generated_ids)
        finish = model(claim, [13], offset, finish="stop", instance="b")._replace(env_s=0.125, wait_s=0.25)
        assert log.log([finish, finish]) == [True, True]
    first, second = log.read_group(0, 0)
    (third,) = log.read_group(0, 1)
    assert (first.migrations, second.migrations, third.migrations) == (1, 1, 1)
    assert (first.migrated_mid_turn, second.migrated_mid_turn, third.migrated_mid_turn) == (1, 0, 0)
    assert (first.env_s, first.wait_s) == (second.env_s, second.wait_s) == (0.375, 0.75)
    assert all(0 <= r.life_s < 60 for r in (first, second, third))
    samples = samples_of_group([first, second])
    assert [s.migrated_mid_turn for s in samples] == [1, 0] and samples[0].wait_s == 0.75


def test_a_running_trajectorys_lease_shows_its_completed_turns(log):
    """What the controller's snapshot reads for the steal policy (`RunningSample.turns`)."""
    assert log.enqueue_step(0, 4, [group()])
    (claim,) = log.claim(0, "a", 4, 1)
    assert log.step_leases(0, ["a"]).running["a"][0].turns == 0
    assert log.log([model(claim, [10, 11, 12], 0), env(claim, [20, 21], 3, 0, "15012")]) == [True, True]
    (lease,) = log.step_leases(0, ["a"]).running["a"]
    assert (lease.logged, lease.budget, lease.turns) == (5, 32, 1)
