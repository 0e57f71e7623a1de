"""`DirectWeights`: a worker takes exactly the version the trainer handed over, and only that one."""

from __future__ import annotations

from infra.rollout.direct_weights import DirectWeights


def test_take_returns_the_offered_version_only():
    weights = DirectWeights()
    assert weights.version is None and weights.take(0) is None
    first, second = {"w": 1}, {"w": 2}
    weights.offer(0, first)
    assert weights.take(0) is first and weights.take(1) is None
    weights.offer(1, second)
    assert weights.version == 1 and weights.take(1) is second
    assert weights.take(0) is None, "an older version is gone once a newer one is offered"
