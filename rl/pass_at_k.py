"""pass@k and avg@k of an evaluation: pure arithmetic on how many of each problem's samples were correct.

pass@k is the chance that at least one of k responses drawn for a problem is correct. With n >= k
samples per problem of which c are correct, Chen et al. (2021)'s unbiased estimator is
1 - C(n-c, k) / C(n, k), averaged over the problems; it is computed here in exact integer
arithmetic (one correctly rounded division), so it is stable for any n. avg@k, the expected
accuracy of k responses, has the unbiased estimator c / n for every k <= n: the mean accuracy of
all the samples (`avg_at_k`). A sample failed for the infrastructure (None) is left out: its
problem counts with the n it has, in pass@k only for k <= n.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct among `n` samples (1 <= k <= n, 0 <= c <= n)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n; got n={n}, c={c}, k={k}")
    total = comb(n, k)
    return (total - comb(n - c, k)) / total


@dataclass(frozen=True)
class Estimates:
    """pass@k for each k and avg@k of one evaluation, over `problems` problems."""

    pass_at_k: dict[int, float]
    avg_at_k: float
    """Mean accuracy over every sample of every problem (the unbiased avg@k, the same for each k)."""
    problems: int
    samples: int
    """Samples scored, over all problems."""


def estimate(correct: Sequence[Sequence[bool | None]], ks: Sequence[int]) -> Estimates:
    """pass@k for each of `ks` and avg@k from each problem's samples (True: correct, None: failed
    for the infrastructure, left out; pass@k averages over the problems with at least k scored)."""
    scored = [[ok for ok in problem if ok is not None] for problem in correct]
    scored = [problem for problem in scored if problem]
    if not scored:
        return Estimates({k: 0.0 for k in ks}, 0.0, 0, 0)
    counts = [(len(problem), sum(problem)) for problem in scored]
    return Estimates(
        pass_at_k={k: _mean([pass_at_k(n, c, k) for n, c in counts if n >= k]) for k in ks},
        avg_at_k=sum(c / n for n, c in counts) / len(counts),
        problems=len(counts),
        samples=sum(n for n, _ in counts),
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
