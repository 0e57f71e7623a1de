"""Tests for rl/rollout.py and rl/scoring.py: requests, sample files, rewards and advantages."""

from __future__ import annotations

import math

import pytest

from rl.config import GRPOConfig, RolloutConfig
from rl.datasets import PromptRecord
from rl.environments.registry import builtin_reward
from rl.generation import GenerationRequest, GenerationResult
from rl.rewards import ADD_FORMAT
from rl.rollout import (
    Sample,
    build_requests,
    read_samples,
    samples_from_results,
    sampling_params,
    step_seed,
    write_samples,
)
from rl.scoring import score_samples
from rl.tokenizer import build_char_tokenizer
from tests.helpers import hf_on_cpu, tiny_model

TOKENIZER = build_char_tokenizer()
RECORDS = [PromptRecord("12+34=", "46", 1), PromptRecord("100+5=", "105", 2), PromptRecord("7+8=", "15", 3)]


def test_build_requests_groups_ids_and_seed():
    config = RolloutConfig(group_size=3, max_new_tokens=5, temperature=0.8, top_k=7)
    requests = build_requests(TOKENIZER, RECORDS, 4, config, run_seed=9)
    assert len(requests) == len(RECORDS) * 3
    assert [r.sample_id for r in requests] == [f"4/{g}/{i}" for g in range(3) for i in range(3)]
    for k, request in enumerate(requests):
        record = RECORDS[k // 3]
        assert request.prompt_ids == TOKENIZER(record.prompt).input_ids
        assert request.prompt_ids[0] == TOKENIZER.bos_token_id
        assert TOKENIZER.decode(request.prompt_ids, skip_special_tokens=True) == record.prompt
        assert request.max_new_tokens == 5
        assert request.seed == step_seed(9, 4)
        assert request.sampling == sampling_params(config)
        assert request.sampling.temperature == 0.8 and request.sampling.top_k == 7
        assert request.generated_ids == []
    assert build_requests(TOKENIZER, RECORDS, 4, config, run_seed=9) == requests
    other_step = build_requests(TOKENIZER, RECORDS, 5, config, run_seed=9)
    other_run = build_requests(TOKENIZER, RECORDS, 4, config, run_seed=10)
    assert other_step[0].seed != requests[0].seed and other_run[0].seed != requests[0].seed
    assert len({step_seed(s, t) for s in range(20) for t in range(1000)}) == 20 * 1000


def test_rollout_with_the_engine_is_reproducible():
    model, tokenizer = tiny_model(seed=0)
    engine = hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    config = RolloutConfig(group_size=4, max_new_tokens=5)
    requests = build_requests(tokenizer, RECORDS[:2], 1, config, run_seed=0)
    first = samples_from_results(requests, engine.generate(requests), policy_version=3)
    # Order and batch composition do not matter: a sample is a function of its id and the policy.
    by_id = {r.sample_id: r for r in engine.generate(list(reversed(requests)), max_batch_size=3)}
    again = samples_from_results(requests, [by_id[r.sample_id] for r in requests], 3)
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
    for a, b in zip(first, again):  # batch shape changes only the last float digits
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert [s.group for s in first] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(s.policy_version == 3 and len(s.response_ids) == len(s.logprobs) for s in first)
    assert all(1 <= len(s.response_ids) <= 5 and s.finish_reason in ("stop", "length") for s in first)
    assert len({tuple(s.response_ids) for s in first}) > 1  # the group members differ


def test_samples_round_trip(tmp_path):
    samples = [
        Sample("1/0/0", 0, [1, 20, 21], [30, 31, 2], [-0.5, -1.25, -1e-9], "stop", 0),
        Sample("1/0/1", 0, [1, 20, 21], [], [], "length", 0),
        Sample("1/1/0", 1, [1, 22], [40], [-math.inf], "length", 7),
    ]
    path = tmp_path / "rollout.jsonl"
    write_samples(path, samples)
    assert read_samples(path) == samples
    assert len(path.read_text().splitlines()) == 3
    assert not list(tmp_path.glob("*.tmp"))
    write_samples(path, samples[:1])  # replaces, never appends
    assert read_samples(path) == samples[:1]


def sample(group: int, index: int, text: str) -> Sample:
    ids = TOKENIZER(text, add_special_tokens=False).input_ids + [TOKENIZER.eos_token_id]
    return Sample(f"1/{group}/{index}", group, [1], ids, [0.0] * len(ids), "stop", 0)


def test_score_samples_rewards_and_advantages():
    texts = [["46", "45", "46", "x"], ["105", "105", "105", "105"], ["1", "2", "3", "4"]]
    samples = [sample(g, i, t) for g, group in enumerate(texts) for i, t in enumerate(group)]
    exact = builtin_reward("exact_match")
    scores = score_samples(samples, RECORDS, TOKENIZER, exact, exact, 4, GRPOConfig())
    assert scores.rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert scores.correct == [r > 0 for r in scores.rewards]
    # Group 0: mean 0.5, population std 0.5 -> +-1; constant groups get exactly 0.
    assert scores.advantages[:4] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert scores.advantages[4:] == [0.0] * 8
    # Mean-only centring (Dr. GRPO).
    scores = score_samples(samples, RECORDS, TOKENIZER, exact, exact, 4, GRPOConfig(normalize_std=False))
    assert scores.advantages[:4] == pytest.approx([0.5, -0.5, 0.5, -0.5])


def test_score_samples_with_a_format_reward():
    texts = [["46", "the answer is 46", "45", "45 "]]
    samples = [sample(0, i, t) for i, t in enumerate(texts[0])]
    reward = builtin_reward("exact_match", 0.5, ADD_FORMAT)
    exact = builtin_reward("exact_match")
    scores = score_samples(samples, RECORDS[:1], TOKENIZER, reward, exact, 4, GRPOConfig())
    assert scores.rewards == [1.5, 1.0, 0.5, 0.5]
    assert scores.correct == [True, True, False, False]
    mean = sum(scores.rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in scores.rewards) / 4)
    expected = [(r - mean) / (std + 1e-6) for r in scores.rewards]
    assert scores.advantages == pytest.approx(expected, rel=1e-5)


def test_score_samples_uses_each_samples_group_answer():
    # Group 1's answer is 105: a sample saying 46 in group 1 is wrong there.
    samples = [sample(0, 0, "46"), sample(0, 1, "46"), sample(1, 0, "46"), sample(1, 1, "105")]
    exact = builtin_reward("exact_match")
    scores = score_samples(samples, RECORDS[:2], TOKENIZER, exact, exact, 2, GRPOConfig())
    assert scores.rewards == [1.0, 1.0, 0.0, 1.0]


def test_score_samples_count_mismatch():
    exact = builtin_reward("exact_match")
    samples = [sample(0, i, "46") for i in range(3)]
    with pytest.raises(ValueError, match="complete consecutive groups of 4"):
        score_samples(samples, RECORDS[:1], TOKENIZER, exact, exact, 4, GRPOConfig())
    with pytest.raises(ValueError):
        score_samples(samples + samples, RECORDS[:1], TOKENIZER, exact, exact, 3, GRPOConfig())


def test_score_samples_accepts_missing_groups_but_not_partial_ones():
    exact = builtin_reward("exact_match")
    # group 0 dropped by the rollout (a failed sample); group 1 complete
    samples = [sample(1, i, RECORDS[1].answer if i % 2 else "0") for i in range(4)]
    scores = score_samples(samples, RECORDS[:2], TOKENIZER, exact, exact, 4, GRPOConfig())
    assert scores.rewards == [0.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError):
        score_samples(samples[:3], RECORDS[:2], TOKENIZER, exact, exact, 4, GRPOConfig())


def test_samples_from_results_pairs_requests_and_results():
    requests = [GenerationRequest("2/1/0", [1, 5], 3), GenerationRequest("2/1/1", [1, 6], 3)]
    results = [
        GenerationResult("2/1/0", [7, 2], [-0.1, -0.2], "stop"),
        GenerationResult("2/1/1", [8, 9, 10], [-1.0, -2.0, -3.0], "length"),
    ]
    samples = samples_from_results(requests, results, policy_version=5)
    assert samples == [
        Sample("2/1/0", 1, [1, 5], [7, 2], [-0.1, -0.2], "stop", 5),
        Sample("2/1/1", 1, [1, 6], [8, 9, 10], [-1.0, -2.0, -3.0], "length", 5),
    ]
