"""Splitting a step's samples across trainer ranks by tokens (pure: no torch, no processes).

Each rank's forward/backward cost grows with the tokens it holds, not with its count of samples,
so a batch is split by longest-processing-time-first: samples in decreasing order of their
sequence length (prompt + response) go one by one to the rank with the fewest tokens so far. The
running totals of the step carry over from one streamed piece to the next (`TokenBalancer`), so a
rank that got the long sequences of an early group gets the short ones of a later group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class TokenBalancer:
    """Assigns samples to `world_size` ranks, keeping the step's tokens per rank level."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.tokens = [0] * world_size
        """Tokens assigned to each rank in the step so far."""

    def reset(self) -> None:
        """Start a new step."""
        self.tokens = [0] * len(self.tokens)

    def split(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices of the samples (with these sequence lengths) each rank gets, in input order."""
        shares: list[list[int]] = [[] for _ in self.tokens]
        for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            rank = min(range(len(self.tokens)), key=lambda r: (self.tokens[r], r))
            shares[rank].append(index)
            self.tokens[rank] += lengths[index]
        return [sorted(share) for share in shares]


def rounds(shares: Sequence[Sequence[int]], micro_batch_size: int) -> int:
    """Forward/backward passes every rank makes for these shares: the most micro-batches any
    rank needs (ranks with fewer make empty passes, so that ZeRO's collectives stay in step)."""
    return max((math.ceil(len(share) / micro_batch_size) for share in shares), default=0)
