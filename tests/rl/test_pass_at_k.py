"""The unbiased pass@k estimator against brute-force enumeration of every k-subset of the samples,
its stability at large n, avg@k, and the `eval` configuration's bounds on k."""

from __future__ import annotations

from itertools import combinations
from math import comb

import pytest

from infra.run.config import ConfigError, load_config
from rl.pass_at_k import estimate, pass_at_k


def brute_force(n: int, c: int, k: int) -> float:
    """The fraction of the k-subsets of n samples (c of them correct) that hold a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-15)


def test_pass_at_k_edges_and_stability():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 3, 1) == 3 / 8
    # n far beyond what floats of C(n, k) hold: still exact (one correctly rounded division)
    assert pass_at_k(2000, 1, 1) == 1 / 2000
    assert pass_at_k(2000, 10, 1000) == pytest.approx(1 - comb(1990, 1000) / comb(2000, 1000), rel=1e-12)
    assert 0 < pass_at_k(2000, 1, 3) < 1
    for bad in ((4, 2, 5), (4, 5, 1), (4, 2, 0)):
        with pytest.raises(ValueError, match="1 <= k <= n"):
            pass_at_k(*bad)


def test_estimate_averages_over_problems_and_leaves_infrastructure_failures_out():
    correct = [[True, False, False, False], [False] * 4, [True, True, None, None]]
    estimates = estimate(correct, [1, 2, 4])
    assert estimates.problems == 3 and estimates.samples == 10
    assert estimates.avg_at_k == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert estimates.pass_at_k[1] == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert estimates.pass_at_k[2] == pytest.approx((brute_force(4, 1, 2) + 0 + 1) / 3)
    assert estimates.pass_at_k[4] == pytest.approx((1 + 0) / 2)  # the third has 2 scored samples: k=4 leaves it out
    assert estimate([[None], []], [1]).problems == 0


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        ({"eval.k": [1, 4, 8], "eval.samples": 4}, "has k=8 outside 1..eval.samples=4: raise eval.samples to 8"),
        ({"eval.k": [0, 1]}, "has k=0 outside 1..eval.samples=1: k must be at least 1"),
        ({"eval.k": []}, "eval.k is empty: give at least one k"),
    ],
)
def test_k_outside_the_samples_is_one_line_naming_the_key(overrides, line):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert line in str(error.value) and "\n" not in str(error.value)


def test_eval_configuration_reads_samples_per_problem_as_samples():
    config = load_config(None, {"eval.samples_per_problem": 8, "eval.k": [1, 4, 8], "eval.on_checkpoint": True})
    assert (config.eval.samples, config.eval.k, config.eval.on_checkpoint) == (8, (1, 4, 8), True)
    assert load_config(None, {}).eval.k == (1,)
