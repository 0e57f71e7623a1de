"""The speed model of GPUs at paper scale, from public figures (docs/CALIBRATION.md).

* **Decode** (`DecodeModel`) is memory-bound: a step reads the weights and every running sample's KV
  cache at `eta` of the HBM bandwidth, plus a tensor-parallel engine's two all-reduces per layer
  (latency, and each sample's share of the link), so it costs ``a + c * running + b * context``
  (`seconds_per_step_base`, `_per_running`, `_per_context_token`). `n` samples holding `c0`
  context tokens in all gain `dp` tokens each in ``(a + c*n + b*c0) * dp + b * n * dp**2 / 2``
  (`seconds_to_advance`); `tokens_in` is its inverse, the quadratic's root: the simulator integrates
  the roofline exactly between events instead of ticking per token.
* **Concurrency** (`slots`): the KV cache left after the weights over a sample's mean context, at
  most `max_running`. **Prefill**: 2 FLOPs per parameter per token at `prefill_mfu`.
* **Training** (`train_seconds`): FLOPs per parameter per trained token at a measured MFU.
* **Measured** (`MeasuredDecode`, a scenario's `measured` section): speeds timed on a machine
  instead, stretched by `slowdown` when busy processes outnumber the cores. **Weight transfer**
  (`pull_seconds`): the fluid bound of `n` pullers served from a source. Detail: docs/simulator.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    """One GPU type's vendor figures."""

    hbm_gb: float
    hbm_tb_s: float
    """HBM bandwidth, TB/s."""
    bf16_tflops: float
    """Dense bf16 peak, TFLOP/s."""
    link_gb_s: float
    """GPU-to-GPU line rate per direction, GB/s (NVLink; PCIe for a GPU without it): what a
    tensor-parallel engine's all-reduces run over."""


GPUS: dict[str, GPUSpec] = {
    "H100": GPUSpec(hbm_gb=80, hbm_tb_s=3.35, bf16_tflops=989, link_gb_s=450),
    "A100-80G": GPUSpec(hbm_gb=80, hbm_tb_s=2.0, bf16_tflops=312, link_gb_s=300),
    "A100-40G": GPUSpec(hbm_gb=40, hbm_tb_s=1.55, bf16_tflops=312, link_gb_s=300),
    "L4": GPUSpec(hbm_gb=24, hbm_tb_s=0.30, bf16_tflops=121, link_gb_s=32),
}
"""Vendor specs (H100 SXM: NVLink 4; A100 SXM 80/40 GB: NVLink 3; L4: PCIe Gen4 x16), the GPU
types a scenario may name."""


@dataclass(frozen=True)
class ModelShape:
    """What decode and training cost depends on."""

    params: float
    """Parameter count."""
    weight_bytes: float
    kv_bytes_per_token: float
    layers: int = 1
    activation_bytes_per_token: float = 0.0
    """One token's hidden state, the message a tensor-parallel all-reduce sums per sample."""

    @classmethod
    def of(
        cls, params_b: float, layers: int, kv_heads: int, head_dim: int, bytes_per_value: int, hidden_size: int = 0
    ) -> ModelShape:
        """From the architecture: K and V per layer per KV head, `bytes_per_value` each."""
        return cls(
            params=params_b * 1e9,
            weight_bytes=params_b * 1e9 * bytes_per_value,
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * bytes_per_value,
            layers=layers,
            activation_bytes_per_token=hidden_size * bytes_per_value,
        )


@dataclass(frozen=True)
class DecodeModel:
    """One engine: `gpus` GPUs of one type in tensor parallel, serving one model."""

    gpu: GPUSpec
    model: ModelShape
    gpus: int
    eta: float
    """Achieved fraction of the HBM bandwidth."""
    memory_utilization: float
    """Fraction of HBM the engine may use (weights + KV cache)."""
    max_running: int
    prefill_mfu: float
    allreduce_latency_s: float = 0.0
    """Latency of one all-reduce between the engine's GPUs (none with one GPU)."""
    allreduce_efficiency: float = 1.0
    """Fraction of the GPU link's line rate an all-reduce's bus bandwidth reaches."""

    @property
    def _bytes_per_s(self) -> float:
        return self.gpus * self.eta * self.gpu.hbm_tb_s * 1e12

    @property
    def seconds_per_step_base(self) -> float:
        """`a`: the weights' share of one decode step, plus the all-reduces' latency."""
        allreduces = 2 * self.model.layers if self.gpus > 1 else 0
        return self.model.weight_bytes / self._bytes_per_s + allreduces * self.allreduce_latency_s

    @property
    def seconds_per_step_per_running(self) -> float:
        """`c`: one running sample's share of a decode step's all-reduces (ring: each GPU sends
        and receives `2(g-1)/g` of the message, at the bus bandwidth)."""
        if self.gpus == 1:
            return 0.0
        share = 2 * (self.gpus - 1) / self.gpus
        bus = self.allreduce_efficiency * self.gpu.link_gb_s * 1e9
        return 2 * self.model.layers * self.model.activation_bytes_per_token * share / bus

    @property
    def seconds_per_step_per_context_token(self) -> float:
        """`b`: one context token's share of one decode step."""
        return self.model.kv_bytes_per_token / self._bytes_per_s

    def step_seconds(self, running: int, context_tokens: float) -> float:
        """Time of one decode step of `running` samples over `context_tokens` tokens of context in total."""
        return (
            self.seconds_per_step_base
            + self.seconds_per_step_per_running * running
            + self.seconds_per_step_per_context_token * context_tokens
        )

    @property
    def kv_capacity_tokens(self) -> float:
        free = self.gpus * self.gpu.hbm_gb * 1e9 * self.memory_utilization - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"the weights ({self.model.weight_bytes / 1e9:.1f} GB) do not fit on {self.gpus} GPU(s)")
        return free / self.model.kv_bytes_per_token

    def slots(self, mean_context_tokens: float) -> int:
        """Samples the engine runs at once: its KV cache over a sample's mean context, capped."""
        return max(1, min(self.max_running, math.floor(self.kv_capacity_tokens / mean_context_tokens)))

    def seconds_to_advance(self, running: int, context0: float, tokens: float) -> float:
        """Time for each of `running` samples, `context0` context tokens in all, to gain `tokens`."""
        b = self.seconds_per_step_per_context_token
        return self.step_seconds(running, context0) * tokens + b * running * tokens * tokens / 2

    def tokens_in(self, running: int, context0: float, seconds: float) -> float:
        """Tokens each running sample gains in `seconds` (the inverse of `seconds_to_advance`)."""
        if seconds <= 0:
            return 0.0
        k = self.step_seconds(running, context0)
        q = self.seconds_per_step_per_context_token * running
        return 2 * seconds / (k + math.sqrt(k * k + 2 * q * seconds))

    def prefill_seconds(self, tokens: float) -> float:
        return tokens * 2 * self.model.params / (self.gpus * self.prefill_mfu * self.gpu.bf16_tflops * 1e12)


@dataclass(frozen=True)
class MeasuredDecode(DecodeModel):
    """An engine whose speeds were measured on the machine itself (a CPU profile) instead of
    derived from a GPU's vendor figures; `slowdown` stretches every measured time (processes
    sharing fewer cores than they have threads to run)."""

    step_s: float = 0.0
    """One decode step's fixed time."""
    per_context_token_s: float = 0.0
    """Added to a decode step per token of context it runs over."""
    prefill_per_token_s: float = 0.0
    slowdown: float = 1.0

    @property
    def seconds_per_step_base(self) -> float:
        return self.step_s * self.slowdown

    @property
    def seconds_per_step_per_running(self) -> float:
        return 0.0

    @property
    def seconds_per_step_per_context_token(self) -> float:
        return self.per_context_token_s * self.slowdown

    def slots(self, mean_context_tokens: float) -> int:
        """No KV-cache bound: the engine runs `max_running` samples."""
        return self.max_running

    def prefill_seconds(self, tokens: float) -> float:
        return tokens * self.prefill_per_token_s * self.slowdown


def train_seconds(
    tokens: float, model: ModelShape, gpu: GPUSpec, gpus: int, flops_per_param: float, mfu: float
) -> float:
    """Time for `gpus` GPUs to train on `tokens` tokens (all passes of one RL update)."""
    return tokens * flops_per_param * model.params / (gpus * mfu * gpu.bf16_tflops * 1e12)


def pull_seconds(
    weight_bytes: float, pullers: int, source_gbps: float, puller_gbps: float, peers_serve: bool, peers: int = 0
) -> float:
    """Time until all of `pullers` simultaneous pullers hold the weights (fluid bound).

    From one source alone: ``max(W / d, n W / u_s)``. When pullers (and `peers` that already hold
    the version) serve chunks to each other (the swarm): ``max(W / d, W / u_s, n W / (u_s + (n +
    peers) u))``, with every instance's upload equal to its download `puller_gbps`; with peers
    holding the version the trainer need not send every chunk, so the `W / u_s` floor goes too.
    """
    if pullers <= 0:
        return 0.0
    w, d, us = weight_bytes * 8 / 1e9, puller_gbps, source_gbps
    if not peers_serve:
        return max(w / d, pullers * w / us)
    floor = w / d if peers else max(w / d, w / us)
    return max(floor, pullers * w / (us + (pullers + peers) * d))
