"""Bounded staleness in the token log, against a real redis-server: a step's version window,
claims over several open steps (oldest first), and the version spans every flushed chunk records."""

from __future__ import annotations

import uuid

import pytest

from infra.rollout.tokenlog import Flush, GroupSpec, TokenLog, expand_spans

pytestmark = pytest.mark.integration


@pytest.fixture
def log(redis_client) -> TokenLog:
    return TokenLog(redis_client, f"test-{uuid.uuid4().hex[:8]}")


def groups(count: int, n: int, max_new: int = 8) -> list[GroupSpec]:
    return [GroupSpec(g, [1, 2, 3 + g], n, max_new, seed=7, sampling={"temperature": 1.0}) for g in range(count)]


def test_a_step_takes_any_version_of_its_window_and_none_outside():
    assert expand_spans([(0, 3), (2, 5)], 5, 9) == [3, 3, 5, 5, 5]
    assert expand_spans([], 2, 9) == [9, 9]
    assert expand_spans([(1, 4)], 3, 9) == [9, 4, 4]


def test_claims_follow_the_window(log):
    log.enqueue_step(5, 4, groups(1, 2), min_version=2)
    assert log.step_status(5).min_version == 2
    assert log.claim(5, "a", policy_version=1, max_samples=4) == []  # older than the window
    assert log.claim(5, "a", policy_version=5, max_samples=4) == []  # newer than the step trains from
    assert [c.sample_id for c in log.claim(5, "a", policy_version=2, max_samples=1)] == ["5/0/0"]
    assert [c.sample_id for c in log.claim(5, "b", policy_version=4, max_samples=4)] == ["5/0/1"]
    with pytest.raises(ValueError, match="min_version 5 outside"):
        log.enqueue_step(6, 4, groups(1, 2), min_version=5)


def test_strict_steps_take_exactly_their_version(log):
    log.enqueue_step(1, 0, groups(1, 2))
    assert log.step_status(1).min_version == 0
    assert log.claim(1, "a", policy_version=1, max_samples=4) == []
    assert len(log.claim(1, "a", policy_version=0, max_samples=4)) == 2


def test_several_open_steps_are_claimed_oldest_first_within_each_window(log):
    log.enqueue_step(3, 2, groups(1, 2), min_version=1)
    log.enqueue_step(4, 3, groups(1, 2), min_version=2)
    claims = log.claim([3, 4], "a", policy_version=2, max_samples=3)
    assert [c.sample_id for c in claims] == ["3/0/0", "3/0/1", "4/0/0"]
    # version 1 is inside step 3's window only: step 4 gives it nothing
    log.enqueue_step(5, 4, groups(1, 1), min_version=3)
    assert [c.sample_id for c in log.claim([3, 4, 5], "b", policy_version=3, max_samples=5)] == ["4/0/1", "5/0/0"]


def test_every_flushed_chunk_records_its_version_and_stale_ones_are_refused(log):
    log.enqueue_step(7, 6, groups(1, 1), min_version=4)
    (claim,) = log.claim(7, "a", policy_version=4, max_samples=1)
    sid, epoch = claim.sample_id, claim.epoch
    assert log.log([Flush(sid, "a", epoch, [10, 11], [-0.5, -0.25], 0, None, 4)]) == [True]
    assert log.log([Flush(sid, "a", epoch, [12], [-0.5], 2, None, 4)]) == [True]  # same version: no new span
    assert log.log([Flush(sid, "a", epoch, [13], [-0.5], 3, None, 3)]) == [False]  # below the window
    assert log.log([Flush(sid, "a", epoch, [13, 14], [-0.5, -0.5], 3, None, 6)]) == [True]  # continued on 6
    assert log.log([Flush(sid, "a", epoch, [15], [-0.5], 5, "length", 6)]) == [True]
    (record,) = log.read_group(7, 0)
    assert record.token_ids == [10, 11, 12, 13, 14, 15]
    assert record.version_spans == ((0, 4), (3, 6))
    assert record.token_versions() == [4, 4, 4, 6, 6, 6]
    assert record.policy_version == 6
    assert log.stats().rejected_appends == 1


def test_versions_of_discarded_tokens_go_with_them(log):
    log.enqueue_step(2, 1, groups(1, 1), min_version=0)
    (claim,) = log.claim(2, "a", policy_version=0, max_samples=1)
    assert log.log([Flush(claim.sample_id, "a", claim.epoch, [5, 6], [-1.0, -1.0], 0, None, 0)]) == [True]
    assert log.release(claim.sample_id, "a", claim.epoch, keep_tokens=False)
    (again,) = log.claim(2, "b", policy_version=1, max_samples=1)
    assert again.generated_ids == []
    assert log.log([Flush(again.sample_id, "b", again.epoch, [7], [-1.0], 0, "stop", 1)]) == [True]
    (record,) = log.read_group(2, 0)
    assert record.version_spans == ((0, 1),)
