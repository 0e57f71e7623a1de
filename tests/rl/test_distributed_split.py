"""Tests for rl/distributed/split.py: samples go to ranks by tokens, and every rank makes the same passes."""

from __future__ import annotations

import random

import pytest

from rl.distributed.split import TokenBalancer, rounds


def test_the_split_levels_tokens_not_counts():
    lengths = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    shares = TokenBalancer(2).split(lengths)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    tokens = [sum(lengths[i] for i in share) for share in shares]
    assert tokens == [100, 100]
    assert sorted(len(share) for share in shares) == [1, 10]  # by count it would be 6 and 5


def test_the_running_totals_carry_over_streamed_pieces():
    balancer = TokenBalancer(2)
    first = balancer.split([50, 5])
    second = balancer.split([5, 5, 5, 5, 5, 5, 5, 5, 5])
    assert first == [[0], [1]]
    # the rank that got 5 tokens gets most of the next piece
    assert len(second[1]) > len(second[0])
    assert abs(balancer.tokens[0] - balancer.tokens[1]) <= 5
    balancer.reset()
    assert balancer.tokens == [0, 0]


def test_random_splits_stay_within_one_sample_of_level():
    rng = random.Random(0)
    for _ in range(200):
        world = rng.randint(1, 5)
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(0, 40))]
        balancer = TokenBalancer(world)
        shares = balancer.split(lengths)
        assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
        assert all(share == sorted(share) for share in shares)
        if lengths:
            assert max(balancer.tokens) - min(balancer.tokens) <= max(lengths)


def test_rounds_is_the_most_micro_batches_of_any_rank():
    assert rounds([[0, 1, 2], [3]], 2) == 2
    assert rounds([[], []], 4) == 0
    assert rounds([[0], []], 4) == 1
    with pytest.raises(ValueError, match="world_size"):
        TokenBalancer(0)
