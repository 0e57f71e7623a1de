"""Tests for rl/trainer.py: exact micro-batching, the strict and mini-batch updates, the decoupled
objective, on-policy ratios, learning direction, reference, validation."""

from __future__ import annotations

import copy
import math
import random
import sys
from pathlib import Path

import pytest
import torch

import rl
from rl.config import GRPOConfig, OptimConfig
from rl.generation import GenerationRequest, SamplingParams
from rl.models import build_tiny_llama
from rl.trainer import TrainBatch, _pack, concat_batches, mini_batches
from tests.helpers import hf_on_cpu, run_trainer, tiny_shape

SHAPE = tiny_shape()
PAD, BOS, EOS = 0, 1, 2


def tiny_model(seed: int = 0):
    model, _ = build_tiny_llama(SHAPE, seed=seed)
    return model


def random_batch(size: int = 10, seed: int = 0, empty_response: bool = True) -> TrainBatch:
    rng = random.Random(seed)
    prompts, responses, logprobs, advantages = [], [], [], []
    for i in range(size):
        prompts.append([BOS] + [rng.randrange(4, 100) for _ in range(rng.randint(2, 9))])
        length = 0 if (empty_response and i == 4) else rng.randint(1, 7)
        responses.append([rng.randrange(4, 100) for _ in range(length)])
        # Not the model's log-probs: the decoupled objective's weights are far from 1 (truncated).
        logprobs.append([-4.6 + rng.uniform(-1.5, 1.5) for _ in range(length)])
        advantages.append(rng.uniform(-1.5, 1.5))
    return TrainBatch(prompts, responses, logprobs, advantages)


def sequence_logprob(model, prompt: list[int], response: list[int]) -> float:
    """Sum of log-probs of `response` after `prompt`, computed independently of the trainer."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return float(sum(logp[len(prompt) - 1 + j, tok] for j, tok in enumerate(response)))


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize(("objective", "updates"), [("grpo", 1), ("decoupled", 1), ("grpo", 2)])
def test_micro_batching_gives_the_full_batch_update(aggregation, objective, updates):
    batch = random_batch()
    results = []
    for micro in (3, 64):
        model = tiny_model()
        trainer = run_trainer(
            model,
            PAD,
            GRPOConfig(aggregation=aggregation, objective=objective),
            # lr 1e-4: Adam's first step moves every weight by about lr * sign(grad); a wrong
            # micro-batch weighting shows in the gradients (compared tightly below) and, for
            # any sign it flips, as a 2e-4 parameter difference. Gradients of ~1e-8 (near Adam's
            # eps) may legitimately differ in their last digits and move by < 1e-5.
            OptimConfig(lr=1e-4, micro_batch_size=micro, updates_per_step=updates, max_grad_norm=1e9),
        )
        metrics = trainer.train_step(batch)
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((params(model), grads, metrics))
    (p3, g3, m3), (p64, g64, m64) = results
    assert g3.keys() == g64.keys() and len(g3) > 0
    for name in g3:
        torch.testing.assert_close(g3[name], g64[name], rtol=1e-4, atol=1e-6, msg=name)
    for name in p3:
        torch.testing.assert_close(p3[name], p64[name], rtol=0, atol=1e-5, msg=name)
    for key in ("loss", "policy_loss", "grad_norm", "entropy", "rollout_logprob_gap", "response_tokens"):
        assert m3[key] == pytest.approx(m64[key], rel=1e-4, abs=1e-6), key
    for key in ("is_weight_mean", "is_weight_deviation", "is_truncated_fraction", "ratio_mean", "clip_fraction"):
        assert m3[key] == pytest.approx(m64[key], rel=1e-5, abs=1e-6), key
    if objective == "decoupled":
        assert m64["is_truncated_fraction"] > 0  # the fake behaviour log-probs made the cap matter
        assert m64["is_weight_deviation"] > 0
    else:
        assert m64["is_weight_mean"] == 1.0 and m64["is_truncated_fraction"] == 0.0
        assert m64["is_weight_deviation"] == 0.0


def _subset(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    return TrainBatch(
        [batch.prompt_ids[i] for i in rows],
        [batch.response_ids[i] for i in rows],
        [batch.rollout_logprobs[i] for i in rows],
        [batch.advantages[i] for i in rows],
    )


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_streamed_pieces_in_any_order_give_the_whole_batch_update(aggregation):
    """Groups arriving one by one (as the rollout completes them) train exactly like one batch."""
    batch = random_batch(size=12)
    results = []
    for pieces in ([list(range(12))], [[9, 10, 11], [0, 1, 2], [6, 7, 8], [3, 4, 5]]):
        model = tiny_model()
        trainer = run_trainer(
            model, PAD, GRPOConfig(aggregation=aggregation), OptimConfig(lr=1e-4, micro_batch_size=2, max_grad_norm=1e9)
        )
        trainer.begin_step()
        for rows in pieces:
            trainer.accumulate(_subset(batch, rows))
        metrics = trainer.finish_step()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((params(model), grads, metrics))
    (p1, g1, m1), (p4, g4, m4) = results
    for name in g1:
        torch.testing.assert_close(g1[name], g4[name], rtol=1e-4, atol=1e-6, msg=name)
    for name in p1:
        torch.testing.assert_close(p1[name], p4[name], rtol=0, atol=1e-5, msg=name)
    for key in ("loss", "policy_loss", "grad_norm", "entropy", "response_tokens"):
        assert m1[key] == pytest.approx(m4[key], rel=1e-4, abs=1e-6), key


HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")
"""The Tensor methods that copy a value to the host (a device sync on a GPU)."""


@pytest.fixture
def host_reads(monkeypatch) -> list[tuple[str, str, str]]:
    """Every host read of a tensor made by code in rl/: (method, file name, function)."""
    reads: list[tuple[str, str, str]] = []
    package = str(Path(rl.__file__).parent)

    def counting(name: str):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(package):
                reads.append((name, Path(caller.co_filename).name, caller.co_name))
            return original(self, *args, **kwargs)

        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    return reads


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_metrics_are_read_once_per_step_not_per_micro_batch(aggregation, host_reads):
    """accumulate reads no metric on the host; finish_step reads them all in one transfer."""
    trainer = run_trainer(
        tiny_model(), PAD, GRPOConfig(aggregation=aggregation, kl_coef=0.1), OptimConfig(micro_batch_size=2)
    )
    trainer.begin_step()
    trainer.accumulate(random_batch(size=6))
    trainer.accumulate(random_batch(size=4, seed=1))
    # The only read left is policy_loss's check that the mask selects a token; the trainer's
    # masks are host tensors (built from the batch's lists), so it waits for no device.
    assert set(host_reads) <= {("__bool__", "grpo.py", "policy_loss")}
    assert len(host_reads) == 5, "one mask check per micro-batch"
    host_reads.clear()
    metrics = trainer.finish_step()
    assert host_reads == [("tolist", "trainer.py", "_update")]  # one per optimizer update
    assert all(type(value) is float for value in metrics.values())
    assert sorted(metrics) == sorted(
        [
            "loss",
            "policy_loss",
            "kl",
            "clip_fraction",
            "ratio_mean",
            "is_weight_mean",
            "is_weight_deviation",
            "is_truncated_fraction",
            "rollout_logprob_gap",
            "grad_norm",
            "entropy",
            "lr",
            "response_tokens",
            "peak_rss_mb",
        ]
    )


def test_streaming_protocol_errors_and_abandon():
    model = tiny_model()
    trainer = run_trainer(model, PAD, GRPOConfig(), OptimConfig(lr=1e-2))
    before = params(model)
    with pytest.raises(RuntimeError, match="begin_step"):
        trainer.accumulate(random_batch(size=2))
    with pytest.raises(RuntimeError, match="begin_step"):
        trainer.finish_step()
    trainer.begin_step()
    trainer.accumulate(random_batch(size=4))
    assert trainer.accumulating
    trainer.abandon_step()
    assert not trainer.accumulating and trainer.step == 0
    assert all(p.grad is None for p in model.parameters())
    for name, value in params(model).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    trainer.begin_step()
    with pytest.raises(ValueError, match="no response tokens"):
        trainer.finish_step()


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_aggregation_weights_match_a_direct_computation(aggregation):
    """The trainer's loss equals the hand-computed GRPO loss (one update: ratio 1, loss = -A mean)."""
    batch = random_batch()
    trainer = run_trainer(tiny_model(), PAD, GRPOConfig(aggregation=aggregation), OptimConfig(micro_batch_size=3))
    metrics = trainer.train_step(batch)
    rows = [(len(r), a) for r, a in zip(batch.response_ids, batch.advantages) if r]
    if aggregation == "token":
        expected = -sum(n * a for n, a in rows) / sum(n for n, _ in rows)
    else:
        expected = -sum(a for _, a in rows) / len(rows)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_one_update_per_step_has_unit_ratio_and_no_clipping():
    trainer = run_trainer(tiny_model(), PAD, GRPOConfig(clip_eps=0.01), OptimConfig(lr=1e-3, micro_batch_size=4))
    for seed in range(2):
        metrics = trainer.train_step(random_batch(seed=seed))
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["clip_fraction"] == 0.0
        assert metrics["kl"] == 0.0
        assert metrics["rollout_logprob_gap"] > 0.1  # the batch's log-probs were fake
    assert trainer.step == 2


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_agree_with_the_trainer(temperature):
    """Sampled with HFEngine (left padding, KV cache) vs scored by the trainer (right padding)."""
    model = tiny_model(seed=1)
    engine = hf_on_cpu(model, EOS, PAD, max_batch_size=16)
    rng = random.Random(0)
    requests = [
        GenerationRequest(
            sample_id=f"s{i}",
            prompt_ids=[BOS] + [rng.randrange(4, 100) for _ in range(rng.randint(3, 8))],
            max_new_tokens=6,
            seed=11,
            sampling=SamplingParams(temperature=temperature),
        )
        for i in range(8)
    ]
    results = engine.generate(requests)
    batch = TrainBatch(
        [r.prompt_ids for r in requests],
        [r.token_ids for r in results],
        [r.new_logprobs for r in results],
        [1.0, -1.0] * 4,
    )
    trainer = run_trainer(model, PAD, GRPOConfig(), OptimConfig(micro_batch_size=3), temperature=temperature)
    metrics = trainer.train_step(batch)
    assert metrics["rollout_logprob_gap"] < 1e-4
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_positive_advantage_raises_the_response_logprob():
    model = tiny_model()
    prompt = [BOS, 20, 21, 14, 22]
    good, bad = [30, 31, 32, EOS], [40, 41, 42, EOS]
    before = sequence_logprob(model, prompt, good), sequence_logprob(model, prompt, bad)
    trainer = run_trainer(model, PAD, GRPOConfig(), OptimConfig(lr=1e-2))
    batch = TrainBatch([prompt, prompt], [good, bad], [[0.0] * 4, [0.0] * 4], [1.0, -1.0])
    for _ in range(3):
        trainer.train_step(batch)
    after = sequence_logprob(model, prompt, good), sequence_logprob(model, prompt, bad)
    assert after[0] > before[0] + 0.5
    assert after[1] < before[1] - 0.5


def test_zero_advantage_leaves_parameters_unchanged():
    model = tiny_model()
    start = params(model)
    trainer = run_trainer(model, PAD, GRPOConfig(), OptimConfig(lr=1e-2))
    batch = random_batch()
    batch.advantages = [0.0] * len(batch)
    trainer.train_step(batch)
    for name, value in params(model).items():
        torch.testing.assert_close(value, start[name], rtol=0, atol=0, msg=name)


def test_kl_creates_a_frozen_reference():
    model = tiny_model()
    start = params(model)
    assert run_trainer(model, PAD, GRPOConfig(), OptimConfig()).reference is None
    trainer = run_trainer(model, PAD, GRPOConfig(kl_coef=0.5), OptimConfig(lr=1e-2))
    reference = trainer.reference
    assert reference is not None and reference is not model
    assert not any(p.requires_grad for p in reference.parameters())
    first = trainer.train_step(random_batch(seed=0))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy still equals the reference
    second = trainer.train_step(random_batch(seed=1))
    assert second["kl"] > 1e-6
    assert trainer.reference is reference
    for name, value in reference.named_parameters():
        torch.testing.assert_close(value, start[name], rtol=0, atol=0, msg=name)
    moved = params(model)
    assert any(not torch.equal(moved[name], start[name]) for name in start)
    # Not shared storage with the policy.
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(reference.parameters(), model.parameters()))


@pytest.mark.parametrize("updates", [1, 3])
def test_warmup_schedule_and_version_advance_once_per_rl_step(updates):
    trainer = run_trainer(
        tiny_model(), PAD, GRPOConfig(), OptimConfig(lr=1e-3, warmup_steps=3, updates_per_step=updates)
    )
    lrs = [trainer.train_step(random_batch(seed=s))["lr"] for s in range(5)]
    assert lrs == pytest.approx([2e-3 / 4, 3e-3 / 4, 1e-3, 1e-3, 1e-3])
    assert trainer.step == 5


def test_bad_batches_raise_value_error():
    with pytest.raises(ValueError, match="length"):
        TrainBatch([[BOS]], [[5], [6]], [[0.0], [0.0]], [1.0, 1.0])
    with pytest.raises(ValueError, match="length"):
        TrainBatch([[BOS], [BOS]], [[5], [6]], [[0.0], [0.0]], [1.0])
    with pytest.raises(ValueError, match="log-probs"):
        TrainBatch([[BOS]], [[5, 6]], [[0.0]], [1.0])
    with pytest.raises(ValueError, match="empty prompt"):
        TrainBatch([[]], [[5, 6]], [[0.0, 0.0]], [1.0])
    trainer = run_trainer(tiny_model(), PAD, GRPOConfig(), OptimConfig())
    with pytest.raises(ValueError, match="empty"):
        trainer.train_step(TrainBatch([], [], [], []))
    with pytest.raises(ValueError, match="no response tokens"):
        trainer.train_step(TrainBatch([[BOS, 5], [BOS]], [[], []], [[], []], [1.0, -1.0]))
    assert trainer.step == 0


def test_bf16_autocast_keeps_fp32_weights_and_follows_the_fp32_step():
    """Mixed precision: the forward/backward run in bf16, the weights and AdamW state stay fp32, and
    one step moves the parameters as the fp32 step does (to bf16's precision)."""
    batch = random_batch(seed=3)
    fp32_model, bf16_model = tiny_model(), tiny_model()
    start = params(fp32_model)
    run_trainer(fp32_model, PAD, GRPOConfig(), OptimConfig(lr=1e-2)).train_step(batch)
    trainer = run_trainer(bf16_model, PAD, GRPOConfig(), OptimConfig(lr=1e-2), autocast_dtype=torch.bfloat16)
    metrics = trainer.train_step(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert {p.dtype for p in bf16_model.parameters()} == {torch.float32}
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values())
    want, got = params(fp32_model), params(bf16_model)
    moved = sum((want[k] - start[k]).abs().sum() for k in want)
    off = sum((got[k] - want[k]).abs().sum() for k in want)
    assert off < 0.1 * moved, (off, moved)


def test_positive_advantage_raises_the_response_logprob_under_bf16():
    model = tiny_model()
    prompt = [BOS, 20, 21, 14, 22]
    good, bad = [30, 31, 32, EOS], [40, 41, 42, EOS]
    before = sequence_logprob(model, prompt, good), sequence_logprob(model, prompt, bad)
    trainer = run_trainer(model, PAD, GRPOConfig(), OptimConfig(lr=3e-3), autocast_dtype=torch.bfloat16)
    batch = TrainBatch([prompt, prompt], [good, bad], [[0.0] * 4, [0.0] * 4], [1.0, -1.0])
    for _ in range(3):
        trainer.train_step(batch)
    after = sequence_logprob(model, prompt, good), sequence_logprob(model, prompt, bad)
    assert after[0] > before[0] + 0.5 and after[1] < before[1] - 0.5


# -- the strict update, several updates per step, the decoupled objective ---------------------


def _previous_update(model, batch: TrainBatch, optim: OptimConfig, clip_eps: float = 0.2) -> None:
    """One RL step with the previous trainer's math, written out here: a no-grad forward for the
    old log-probs, a training forward, the clipped surrogate on their ratio (1), the token mean
    over the batch, gradient clipping and one AdamW step."""
    width = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    ids = torch.full((len(batch), width), PAD)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
    positions = (attention.cumsum(1) - 1).clamp(min=0)

    def response_logprobs() -> list[torch.Tensor]:
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), dim=-1)
        return [
            torch.stack([logp[i, len(p) - 1 + j, tok] for j, tok in enumerate(r)])
            for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids))
            if r
        ]

    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    model.eval()
    with torch.no_grad():
        old = response_logprobs()
    model.train()
    new = response_logprobs()
    advantages = [a for a, r in zip(batch.advantages, batch.response_ids) if r]
    terms = []
    for logp, old_logp, a in zip(new, old, advantages):
        ratio = torch.exp(logp - old_logp)
        terms.append(-torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a))
    loss = torch.cat(terms).sum() / sum(len(t) for t in terms)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), optim.max_grad_norm)
    optimizer.step()


def test_one_update_per_step_is_the_previous_codes_update():
    """Strict mode (`grpo`, U = 1) is exactly the update of the trainer that recomputed old log-probs."""
    batch = random_batch(size=8)
    model = tiny_model()
    reference = copy.deepcopy(model)
    # lr 1e-4: Adam's first step moves each weight by about lr (so a wrong weighting or a sign
    # shows as ~1e-4), and a gradient near Adam's eps (1e-8) that differs in its last float digits
    # (the loss is summed in another order) moves by up to ~lr * 2e-3, far below 1e-6.
    # max_grad_norm 1: the norm clipping acts too.
    optim = OptimConfig(lr=1e-4, micro_batch_size=64)
    metrics = run_trainer(model, PAD, GRPOConfig(), optim).train_step(batch)
    _previous_update(reference, batch, optim)
    want, got = params(reference), params(model)
    start = params(tiny_model())
    assert max((got[k] - start[k]).abs().max().item() for k in got) > 5e-5
    for name, parameter in model.named_parameters():
        expected = dict(reference.named_parameters())[name].grad
        torch.testing.assert_close(parameter.grad, expected, rtol=1e-4, atol=1e-8, msg=name)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0


def _two_groups() -> TrainBatch:
    """Two groups of three responses (a group: consecutive samples of one prompt)."""
    rng = random.Random(5)
    prompts, responses, logprobs, advantages = [], [], [], []
    for prompt in ([BOS, 20, 21, 14, 22], [BOS, 30, 31, 15]):
        for a in (1.0, -0.5, -0.5):
            response = [rng.randrange(4, 100) for _ in range(5)]
            prompts.append(prompt)
            responses.append(response)
            logprobs.append([-4.0] * 5)
            advantages.append(a)
    return TrainBatch(prompts, responses, logprobs, advantages)


def test_mini_batches_are_whole_groups_when_the_batch_allows():
    batch = _two_groups()
    assert mini_batches(batch, 1) == [range(0, 6)]
    assert mini_batches(batch, 2) == [range(0, 3), range(3, 6)]
    assert mini_batches(batch, 3) == [range(0, 2), range(2, 4), range(4, 6)]  # 2 groups < 3: equal shares
    assert mini_batches(batch, 9) == [range(i, i + 1) for i in range(6)]
    uneven = concat_batches([_subset(batch, [0, 1, 2]), _subset(batch, [3]), _subset(batch, [0, 1])])
    assert mini_batches(uneven, 2) == [range(0, 3), range(3, 6)]  # boundaries at 3, 4: 3 is nearest to 3
    with pytest.raises(ValueError, match="count"):
        mini_batches(batch, 0)


def test_with_several_updates_the_clip_acts_from_the_second_update():
    """U = 2: the second mini-batch's ratio to the step-start policy has left [1 - eps, 1 + eps]
    after the first update, and the clipped surrogate's update differs from an unclipped one."""
    batch = _two_groups()
    optim = OptimConfig(lr=3e-2, micro_batch_size=2, updates_per_step=2, max_grad_norm=1e9)
    results = {}
    for name, grpo in (
        ("clipped", GRPOConfig(clip_eps=0.05)),
        ("unclipped", GRPOConfig(clip_eps=0.999, clip_eps_high=1e6)),  # a band no ratio leaves
    ):
        model = tiny_model()
        metrics = run_trainer(model, PAD, grpo, optim).train_step(batch)
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        results[name] = (params(model), grads, metrics)
    (p_clip, g_clip, m_clip), (p_free, g_free, m_free) = results["clipped"], results["unclipped"]
    assert m_free["clip_fraction"] == 0.0
    assert m_clip["clip_fraction"] > 0.1  # of all tokens; the first mini-batch's ratio is exactly 1
    assert abs(m_free["ratio_mean"] - 1.0) > 0.01  # the second mini-batch moved with the first update
    # The last update's gradient (the second mini-batch's) and the parameters: clipped tokens
    # contribute no gradient. (Identical if policy_loss dropped the clip.)
    grad_gap = max((g_clip[k] - g_free[k]).abs().max().item() for k in g_clip)
    param_gap = max((p_clip[k] - p_free[k]).abs().max().item() for k in p_clip)
    assert grad_gap > 1e-3, grad_gap
    assert param_gap > 1e-3, param_gap


def test_the_first_of_several_updates_is_the_strict_update():
    """U = 2 on one group only (then two equal shares): the first update's ratio is exactly 1, so
    after it the policy equals a U = 1 step on the first mini-batch."""
    batch = _subset(_two_groups(), [0, 1, 2, 3])
    first = _subset(batch, [0, 1, 2])  # mini_batches: the first group, then the second's sample
    assert mini_batches(batch, 2) == [range(0, 3), range(3, 4)]
    optim = OptimConfig(lr=1e-2, micro_batch_size=2, max_grad_norm=1e9)
    strict = tiny_model()
    run_trainer(strict, PAD, GRPOConfig(), optim).train_step(first)
    several = tiny_model()
    trainer = run_trainer(several, PAD, GRPOConfig(), optim.model_copy(update={"updates_per_step": 2}))
    seen = []
    original = trainer._update

    def spy(acc, where):
        result = original(acc, where)
        seen.append(params(several))
        return result

    trainer._update = spy
    trainer.train_step(batch)
    assert len(seen) == 2 and trainer.step == 1
    for name, value in params(strict).items():
        torch.testing.assert_close(seen[0][name], value, rtol=0, atol=1e-7, msg=name)


def test_accumulated_pieces_with_several_updates_equal_train_step():
    batch = _two_groups()
    optim = OptimConfig(lr=1e-2, micro_batch_size=2, updates_per_step=2)
    whole, pieces = tiny_model(), tiny_model()
    m1 = run_trainer(whole, PAD, GRPOConfig(), optim).train_step(batch)
    trainer = run_trainer(pieces, PAD, GRPOConfig(), optim)
    trainer.begin_step()
    trainer.accumulate(_subset(batch, [0, 1, 2]))
    trainer.accumulate(_subset(batch, [3, 4, 5]))
    assert all(p.grad is None for p in pieces.parameters())  # nothing trained before finish_step
    m2 = trainer.finish_step()
    for name, value in params(whole).items():
        torch.testing.assert_close(params(pieces)[name], value, rtol=0, atol=0, msg=name)
    # peak_rss_mb measures the process, which other tests of the same xdist worker grow meanwhile
    assert {k: v for k, v in m1.items() if k != "peak_rss_mb"} == {k: v for k, v in m2.items() if k != "peak_rss_mb"}
    assert m1.keys() == m2.keys()


def _model_token_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return [float(logp[len(prompt) - 1 + j, tok]) for j, tok in enumerate(response)]


def test_decoupled_applies_the_truncated_importance_weight():
    """Behaviour log-probs set to the model's minus ln w per sequence: w = 0.5, 3 (truncated to the
    cap 2) and 1.5. With one update the ratio is 1, so the decoupled gradient is the grpo gradient
    with each advantage times its sequence's w."""
    base = _two_groups()
    batch = _subset(base, [0, 1, 3])
    model = tiny_model()
    weights, capped = [0.5, 3.0, 1.5], [0.5, 2.0, 1.5]
    behaviour = [
        [lp - math.log(w) for lp in _model_token_logprobs(model, p, r)]
        for p, r, w in zip(batch.prompt_ids, batch.response_ids, weights)
    ]
    decoupled_batch = TrainBatch(batch.prompt_ids, batch.response_ids, behaviour, batch.advantages)
    scaled = TrainBatch(
        batch.prompt_ids, batch.response_ids, behaviour, [a * w for a, w in zip(batch.advantages, capped)]
    )
    optim = OptimConfig(lr=1e-3, micro_batch_size=2, max_grad_norm=1e9)
    grads = {}
    for name, grpo, data in (
        ("decoupled", GRPOConfig(objective="decoupled", tis_cap=2.0), decoupled_batch),
        ("scaled", GRPOConfig(objective="grpo"), scaled),
    ):
        policy = copy.deepcopy(model)
        metrics = run_trainer(policy, PAD, grpo, optim).train_step(data)
        grads[name] = {k: p.grad.detach().clone() for k, p in policy.named_parameters() if p.grad is not None}
        if name == "decoupled":
            # 5 tokens per sequence: mean w = (0.5 + 2 + 1.5) / 3; one sequence of three truncated;
            # |proximal - behaviour| = ln w per token: (ln 2 + ln 3 + ln 1.5) / 3.
            assert metrics["is_weight_mean"] == pytest.approx(4.0 / 3, abs=1e-5)
            assert metrics["is_truncated_fraction"] == pytest.approx(1 / 3, abs=1e-6)
            gap = (math.log(2.0) + math.log(3.0) + math.log(1.5)) / 3
            assert metrics["rollout_logprob_gap"] == pytest.approx(gap, abs=1e-5)
            assert metrics["ratio_mean"] == 1.0
    for name in grads["decoupled"]:
        torch.testing.assert_close(grads["decoupled"][name], grads["scaled"][name], rtol=1e-4, atol=1e-7, msg=name)


def test_auto_objective_is_grpo_in_the_trainer():
    trainer = run_trainer(tiny_model(), PAD, GRPOConfig(objective="auto"), OptimConfig())
    assert trainer.objective == "grpo"
    metrics = trainer.train_step(random_batch())
    assert metrics["is_weight_mean"] == 1.0 and metrics["is_truncated_fraction"] == 0.0


def test_batched_logprobs_equal_each_row_scored_alone():
    """Prompts of different lengths (left-padded) and responses of different lengths (right-padded):
    each response token's log-prob in the batch is the one the model gives that row unpadded, and
    the logits the trainer keeps are the response positions' only."""
    model = tiny_model()
    trainer = run_trainer(model, PAD, GRPOConfig(), OptimConfig())
    batch = random_batch(size=6, empty_response=False)
    packed = _pack(batch.prompt_ids, batch.response_ids, [batch.mask(i) for i in range(len(batch))], PAD)
    with torch.no_grad():
        logprobs, logits = trainer._logprobs(trainer.model, packed)
    assert logits.shape[:2] == (6, max(len(r) for r in batch.response_ids))
    for row, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        alone = _model_token_logprobs(model, prompt, response)
        torch.testing.assert_close(logprobs[row, : len(response)], torch.tensor(alone), rtol=0, atol=1e-5)
