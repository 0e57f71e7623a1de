"""The AdamW the trainers use: torch's fused kernel, on every device torch has one for (CPU, CUDA).

By default torch runs AdamW on a CPU as a loop over the tensors: on the demo's 38-tensor model one
step took 77 ms that way, 3.2 ms on the multi-tensor (`foreach`) kernels and 0.6 ms fused
(2026-12-03, 2-core AMD EPYC, the machine loaded). The three compute the same update up to float
rounding, and their checkpoints (`state_dict`) are interchangeable.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def adamw(parameters: Iterable[torch.nn.Parameter], **options) -> torch.optim.AdamW:
    """`torch.optim.AdamW(parameters, **options)` on torch's fused kernel."""
    return torch.optim.AdamW(parameters, fused=True, **options)
