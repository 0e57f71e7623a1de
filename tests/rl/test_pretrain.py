"""Tests for rl/pretrain.py: corpus noise, the accuracy-threshold stop, saving, giving up."""

from __future__ import annotations

import random

import pytest
import torch

import rl.pretrain as pretrain_module
from rl.config import ModelConfig, PretrainConfig
from rl.models import load_model
from rl.pretrain import ThresholdNotReached, _supervised_batch, corrupt_solution, pretrain
from rl.problems import eval_set, make_problem, problem_stream, take
from rl.tokenizer import build_char_tokenizer
from tests.helpers import tiny_model

SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)


def _final_number_span(solution: str) -> int:
    return len(solution) - len(solution.rsplit("=", 1)[-1])


@pytest.mark.parametrize("family", ["add", "chain"])
def test_corrupt_solution_changes_exactly_one_digit_of_the_final_number(family):
    rng = random.Random(0)
    positions = set()
    for problem in take(problem_stream(family, 0), 300):
        solution = problem.solution
        corrupted = corrupt_solution(solution, rng)
        assert len(corrupted) == len(solution)
        diffs = [i for i, (a, b) in enumerate(zip(solution, corrupted)) if a != b]
        assert len(diffs) == 1, (solution, corrupted)
        (i,) = diffs
        assert i >= _final_number_span(solution)
        assert corrupted[i].isdigit()
        assert corrupted.rsplit("=", 1)[-1] != problem.answer
        positions.add(i - _final_number_span(solution))
    assert len(positions) >= 3  # every digit of the final number can be hit


def test_corrupt_chain_keeps_the_intermediate_steps():
    solution = make_problem((12, 345, 67, 8), "chain").solution  # 357+67=424+8=432
    for seed in range(50):
        corrupted = corrupt_solution(solution, random.Random(seed))
        assert corrupted.startswith("357+67=424+8=") and corrupted != solution


def test_supervised_batch_masks_the_prompt_and_applies_the_error_rate():
    tokenizer = build_char_tokenizer()
    problems = take(problem_stream("add", 0), 20)
    clean = _supervised_batch(tokenizer, problems, 0.0, random.Random(0))
    noisy = _supervised_batch(tokenizer, problems, 1.0, random.Random(0))
    for i, problem in enumerate(problems):
        labels = clean["labels"][i]
        target = labels[labels != -100].tolist()
        assert target == tokenizer(problem.solution, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        prompt_len = len(tokenizer(problem.prompt).input_ids)
        assert (labels[:prompt_len] == -100).all()
        row = clean["input_ids"][i][clean["attention_mask"][i].bool()].tolist()
        assert tokenizer.decode(row, skip_special_tokens=True) == problem.prompt + problem.solution
        noisy_target = noisy["labels"][i][noisy["labels"][i] != -100].tolist()
        assert noisy_target != target and len(noisy_target) == len(target)


def scripted(monkeypatch, values):
    calls = []
    values = iter(values)

    def fake_evaluate(engine, tokenizer, problems, *, max_new_tokens, sampling, **kwargs):
        calls.append((list(problems), max_new_tokens, sampling))
        return next(values)

    monkeypatch.setattr(pretrain_module, "evaluate_accuracy", fake_evaluate)
    return calls


def small_config(tmp_path, **kwargs) -> PretrainConfig:
    values = dict(
        output=tmp_path / "base",
        batch_size=4,
        lr=1e-3,
        warmup_steps=0,
        max_steps=10,
        eval_every=1,
        eval_size=10,
        accuracy_threshold=0.5,
        seed=0,
    )
    values.update(kwargs)
    return PretrainConfig(**values)


def test_stops_at_the_first_evaluation_reaching_the_threshold_and_saves(tmp_path, monkeypatch):
    calls = scripted(monkeypatch, [0.0, 0.2, 0.6, 0.9, 0.9])
    seen = []
    result = pretrain(small_config(tmp_path), SMALL, on_eval=lambda *row: seen.append(row))
    assert result.steps == 3
    assert result.accuracy == pytest.approx(0.6)
    assert [h[0] for h in result.history] == [1, 2, 3]
    assert [h[2] for h in result.history] == [0.0, 0.2, 0.6]
    assert all(h[1] > 0 for h in result.history)
    assert seen == list(result.history)
    assert len(calls) == 3
    problems, max_new_tokens, sampling = calls[0]
    assert problems == eval_set("add", 10)  # the held-out split
    assert sampling.greedy
    assert max_new_tokens == max(len(p.solution) for p in problems) + 1

    model, tokenizer = load_model(tmp_path / "base")
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert tokenizer.decode(tokenizer("12+34=").input_ids, skip_special_tokens=True) == "12+34="
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokenizer("12+34=").input_ids])).logits
    assert torch.isfinite(logits).all()
    # The saved weights are the trained ones, not the fresh init.

    fresh, _ = tiny_model(seed=0)
    assert not torch.equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert not (tmp_path / "base.tmp").exists()


def test_evaluates_only_every_eval_every_steps(tmp_path, monkeypatch):
    calls = scripted(monkeypatch, [0.1, 0.7])
    result = pretrain(small_config(tmp_path, eval_every=2), SMALL)
    assert [h[0] for h in result.history] == [2, 4]
    assert result.steps == 4 and len(calls) == 2


def test_accuracy_is_averaged_over_families(tmp_path, monkeypatch):
    calls = scripted(monkeypatch, [0.2, 0.6, 0.3, 0.8])
    result = pretrain(small_config(tmp_path, families=("add", "chain")), SMALL)
    assert result.steps == 2
    assert [h[2] for h in result.history] == pytest.approx([0.4, 0.55])
    assert {p.family for problems, _, _ in calls for p in problems} == {"add", "chain"}


def test_threshold_not_reached(tmp_path, monkeypatch):
    scripted(monkeypatch, [0.1, 0.2, 0.3])
    with pytest.raises(ThresholdNotReached) as info:
        pretrain(small_config(tmp_path, max_steps=3), SMALL)
    message = str(info.value)
    assert "0.30" in message and "max_steps" in message and "accuracy_threshold" in message
    assert not (tmp_path / "base").exists()


def test_threshold_not_reached_before_any_scheduled_evaluation(tmp_path, monkeypatch):
    """max_steps below eval_every: the last step is still evaluated, and the error is the real one."""
    calls = scripted(monkeypatch, [0.1])
    with pytest.raises(ThresholdNotReached, match="max_steps"):
        pretrain(small_config(tmp_path, max_steps=2, eval_every=5), SMALL)
    assert len(calls) == 1
