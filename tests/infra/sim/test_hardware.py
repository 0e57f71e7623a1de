"""The roofline decode, prefill, training and weight-transfer model against hand-computed figures
for Qwen3-8B on H100 (docs/CALIBRATION.md)."""

from __future__ import annotations

import math

import pytest

from infra.sim.hardware import GPUS, DecodeModel, ModelShape, pull_seconds, train_seconds

QWEN3_8B = ModelShape.of(8.2, layers=36, kv_heads=8, head_dim=128, bytes_per_value=2)
H100 = GPUS["H100"]


def engine(gpus: int = 1, max_running: int = 256) -> DecodeModel:
    return DecodeModel(
        H100, QWEN3_8B, gpus, eta=0.75, memory_utilization=0.85, max_running=max_running, prefill_mfu=0.25
    )


def test_kv_bytes_per_token_is_144_kib_for_qwen3_8b():
    assert QWEN3_8B.kv_bytes_per_token == 144 * 1024
    assert QWEN3_8B.weight_bytes == pytest.approx(16.4e9)


def test_decode_step_time_is_weights_plus_context_over_bandwidth():
    # 16.4 GB / (0.75 * 3.35 TB/s) = 6.527 ms; 100k context tokens add 100e3 * 147456 B / 2.5125e12 = 5.869 ms
    assert engine().step_seconds(1, 0) == pytest.approx(6.527e-3, rel=1e-3)
    assert engine().step_seconds(1, 100_000) == pytest.approx(12.396e-3, rel=1e-3)
    # two GPUs in tensor parallel read half each: half the time
    assert engine(gpus=2).step_seconds(1, 100_000) == pytest.approx(6.198e-3, rel=1e-3)


def test_tensor_parallel_decode_pays_two_all_reduces_per_layer():
    # Qwen3-8B (36 layers, hidden 4096, bf16) on 2 x H100: 72 all-reduces of 6 us add 0.432 ms a
    # step; each running sample adds 72 * 8192 B * 2(2-1)/2 / (0.82 * 450 GB/s) = 1.598 us
    shape = ModelShape.of(8.2, layers=36, kv_heads=8, head_dim=128, bytes_per_value=2, hidden_size=4096)
    tp2 = DecodeModel(H100, shape, 2, 0.75, 0.85, 256, 0.25, allreduce_latency_s=6e-6, allreduce_efficiency=0.82)
    roofline = engine(gpus=2)
    assert tp2.step_seconds(1, 0) - roofline.step_seconds(1, 0) == pytest.approx(0.432e-3 + 1.598e-6, rel=1e-3)
    assert tp2.step_seconds(201, 0) - tp2.step_seconds(1, 0) == pytest.approx(200 * 1.598e-6, rel=1e-3)
    # the integration stays exact with the per-sample term
    steps = sum(tp2.step_seconds(64, 64 * 2000 + 64 * i) for i in range(300))
    assert tp2.seconds_to_advance(64, 64 * 2000, 300) == pytest.approx(steps, rel=2e-3)
    assert tp2.tokens_in(64, 64 * 2000, tp2.seconds_to_advance(64, 64 * 2000, 300)) == pytest.approx(300, rel=1e-9)
    # one GPU has nothing to all-reduce
    tp1 = DecodeModel(H100, shape, 1, 0.75, 0.85, 256, 0.25, allreduce_latency_s=6e-6, allreduce_efficiency=0.82)
    assert tp1.step_seconds(200, 0) == engine().step_seconds(1, 0)


def test_slots_are_bounded_by_the_kv_cache_and_max_running():
    # one H100: (0.85 * 80 GB - 16.4 GB) / 147456 B = 349,935 tokens, 111 samples of 3,142 tokens
    assert engine().kv_capacity_tokens == pytest.approx(349_935, rel=1e-4)
    assert engine().slots(3142) == 111
    # two H100: 811k tokens would hold 258 such samples; max_running caps at 256
    assert engine(gpus=2).slots(3142) == 256


def test_weights_that_do_not_fit_are_refused():
    small = DecodeModel(GPUS["L4"], ModelShape.of(14.8, 40, 8, 128, 2), 1, 0.75, 0.85, 256, 0.25)
    with pytest.raises(ValueError, match="do not fit"):
        small.kv_capacity_tokens


def test_exact_integration_matches_the_sum_of_decode_steps():
    model = engine()
    running, context0, tokens = 64, 64 * 2000, 500
    steps = sum(model.step_seconds(running, context0 + running * i) for i in range(tokens))
    assert model.seconds_to_advance(running, context0, tokens) == pytest.approx(steps, rel=2e-3)
    seconds = model.seconds_to_advance(running, context0, tokens)
    assert model.tokens_in(running, context0, seconds) == pytest.approx(tokens, rel=1e-9)
    assert model.tokens_in(running, context0, 0.0) == 0.0


def test_batch_one_decode_rate_is_the_published_order_of_magnitude():
    # 8B at batch 1 on H100: ~154 tok/s measured (Llama-3.1-8B, vLLM); the model gives ~1 / 6.6 ms
    assert 1 / engine().step_seconds(1, 1000) == pytest.approx(150, rel=0.1)


def test_prefill_and_training_are_compute_bound():
    # 8,192 tokens * 2 * 8.2e9 FLOPs / (0.25 * 989e12) = 0.543 s
    assert engine().prefill_seconds(8192) == pytest.approx(0.5433, rel=1e-3)
    # 1M tokens * 8 * 8.2e9 / (8 GPUs * 0.28 * 989e12) = 29.6 s (4,220 tokens/s/GPU)
    assert train_seconds(1e6, QWEN3_8B, H100, 8, 8, 0.28) == pytest.approx(29.61, rel=1e-3)


def test_pull_time_is_the_fluid_bound_of_the_senders():
    bits = 16.4e9 * 8 / 1e9  # 131.2 Gbit
    # trainer only, 4 pullers: its 100 Gbit/s shared, 5.25 s
    assert pull_seconds(16.4e9, 4, 100, 50, peers_serve=False) == pytest.approx(4 * bits / 100)
    # swarm: each puller's own 50 Gbit/s download is the bound, 2.62 s
    assert pull_seconds(16.4e9, 4, 100, 50, peers_serve=True) == pytest.approx(bits / 50)
    # a joiner with peers holding the version is not held to the trainer's upload
    assert pull_seconds(16.4e9, 1, 10, 50, peers_serve=True, peers=3) == pytest.approx(bits / 50)
    assert pull_seconds(16.4e9, 1, 10, 50, peers_serve=False, peers=3) == pytest.approx(bits / 10)
    assert pull_seconds(16.4e9, 0, 100, 50, peers_serve=True) == 0.0
    assert math.isfinite(pull_seconds(16.4e9, 100, 100, 50, peers_serve=True))
