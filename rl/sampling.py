"""The keyed sampler every torch backend shares (`rl.engine.HFEngine`, `rl.vllm_engine.VLLMEngine`).

Every token is a Gumbel-max draw whose noise is a pure function of (seed, sample_id, response
position, vocab index), computed by a counter-based splitmix64 hash, so a draw never depends on
what else is in the batch, on the engine, or on where a sample was interrupted. A sample released
at any position and resumed on another engine with `generated_ids` continues as if never
interrupted, up to floating point (logits differ in the last bits across batch shapes and
kernels, which can flip a near-tie: the tests require >= 99% of tokens to match).

`keyed_sample` is the whole draw: temperature, top-k / top-p, the noise, argmax, and the log-prob
of each token under the sampling distribution (what the GRPO loss needs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from rl.generation import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int (the reference for `_mix64_tensor`)."""
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _signed(z: int) -> int:
    """The int64 with the same 64 bits as the unsigned `z`."""
    return z - (1 << 64) if z >= 1 << 63 else z


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64 bit patterns."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    """`_mix64` on int64 tensors holding uint64 bit patterns (int64 multiplication wraps)."""
    z = (z ^ _shift_right(z, 30)) * _signed(_MUL1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MUL2)
    return z ^ _shift_right(z, 31)


def sample_key(seed: int, sample_id: str) -> int:
    """64-bit key of one sample's noise stream (stable across processes, unlike `hash()`)."""
    digest = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return _mix64(_mix64((seed + _GOLDEN) & _MASK64) ^ int.from_bytes(digest, "little"))


def gumbel_noise(keys: Sequence[int], positions: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise [rows, vocab]; entry (i, v) depends only on keys[i], positions[i], v."""
    rows = [_signed(_mix64((key + (position + 1) * _GOLDEN) & _MASK64)) for key, position in zip(keys, positions)]
    counters = torch.tensor(rows, dtype=torch.int64, device=device)[:, None]
    vocab = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=device) * _signed(_GOLDEN)
    bits = _mix64_tensor(counters + vocab[None, :])
    uniform = (_shift_right(bits, 11).double() + 0.5) * 2.0**-53  # in (0, 1)
    return -torch.log(-torch.log(uniform)).float()


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    k = top_k[:, None]
    sorted_logits = sorted_logits.masked_fill((k > 0) & (rank >= k), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # the most likely token always has 0 and stays
    p = top_p[:, None]
    sorted_logits = sorted_logits.masked_fill((p < 1) & (mass_before >= p), float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)


def keyed_sample(
    logits: torch.Tensor,
    keys: Sequence[int],
    positions: Sequence[int],
    params: Sequence[SamplingParams],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of fp32 `logits` [rows, vocab]: row i draws with key `keys[i]` at response
    position `positions[i]` under `params[i]`. Returns (tokens [rows] int64, logprobs [rows] fp32),
    the log-probs under the sampling distribution (plain log_softmax for greedy rows)."""
    device = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=device)
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    scaled = logits / temperature[:, None]
    if any(not p.greedy and (p.top_k or p.top_p < 1) for p in params):
        top_k = torch.tensor([0 if p.greedy else p.top_k for p in params], device=device)
        top_p = torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=device)
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    noise = gumbel_noise(keys, positions, scaled.shape[-1], device)
    tokens = torch.where(greedy, scaled.argmax(dim=-1), (scaled + noise).argmax(dim=-1))
    logprobs = scaled.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, logprobs
