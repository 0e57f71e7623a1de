"""StreamedStep: groups trained as they arrive give the whole-step update, and mismatches are caught."""

from __future__ import annotations

import random

import pytest
import torch

from rl.config import GRPOConfig, OptimConfig
from rl.datasets import PromptRecord
from rl.environments.registry import builtin_reward
from rl.models import build_tiny_llama
from rl.rollout import Sample
from rl.scoring import score_samples
from rl.streaming import StreamedStep
from rl.trainer import TrainBatch
from tests.helpers import run_trainer, tiny_shape

SHAPE = tiny_shape()
GROUP = 4


def _step_data(tokenizer):
    """Two prompts, four responses each, some right and some wrong."""
    records = [PromptRecord("12+30=", "42", 1), PromptRecord("7+8=", "15", 2)]
    rng = random.Random(0)
    samples = []
    for group, record in enumerate(records):
        prompt_ids = tokenizer(record.prompt).input_ids
        for index in range(GROUP):
            text = record.answer if index % 2 == 0 else str(rng.randint(0, 99))
            response = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            samples.append(
                Sample(
                    f"1/{group}/{index}",
                    group,
                    prompt_ids,
                    response,
                    [-1.0 - 0.1 * j for j in range(len(response))],
                    "eos",
                    0,
                )
            )
    return records, samples


def _trainer(seed: int = 0, updates: int = 1):
    model, tokenizer = build_tiny_llama(SHAPE, seed=seed)
    optim = OptimConfig(lr=1e-3, micro_batch_size=3, updates_per_step=updates)
    return run_trainer(model, tokenizer.pad_token_id, GRPOConfig(), optim), tokenizer


def _stream(trainer, tokenizer, records):
    reward = builtin_reward("exact_match")
    return StreamedStep(trainer, records, tokenizer, reward, reward, GRPOConfig())


@pytest.mark.parametrize("updates", [1, 2])
def test_groups_streamed_out_of_order_give_the_whole_step_update(updates):
    """U = 1: each group's gradient is accumulated as it arrives; U = 2: groups are only scored as
    they arrive and trained at `finish` in the step's order, so the update is the same too."""
    whole, tokenizer = _trainer(updates=updates)
    records, samples = _step_data(tokenizer)
    reward = builtin_reward("exact_match")
    scores = score_samples(samples, records, tokenizer, reward, reward, GROUP, GRPOConfig())
    assert 0 < sum(scores.correct) < len(samples)
    whole.train_step(
        TrainBatch(
            [s.prompt_ids for s in samples],
            [s.response_ids for s in samples],
            [s.logprobs for s in samples],
            scores.advantages,
        )
    )

    streamed, _ = _trainer(updates=updates)
    stream = _stream(streamed, tokenizer, records)
    stream.add(samples[GROUP:])
    stream.add(samples[:GROUP])
    accumulated = any(p.grad is not None for p in streamed.model.parameters())
    assert accumulated == (updates == 1)
    assert stream.groups == 2 and stream.covers(samples) and stream.busy_s > 0
    stream.finish(samples, scores.advantages)
    assert streamed.step == whole.step == 1
    for (name, a), (_, b) in zip(whole.model.named_parameters(), streamed.model.named_parameters()):
        # Adam's first step divides each gradient element by its own size, so summing the groups in
        # another order moves a weight by up to ~lr * 1e-2 (3e-6 seen with lr 1e-3); a wrong update
        # moves it by ~lr
        assert (a - b).abs().max().item() <= 1e-5, f"{name}: {(a - b).abs().max().item():.3g}"


def test_a_missing_group_or_a_different_advantage_is_refused():
    trainer, tokenizer = _trainer()
    records, samples = _step_data(tokenizer)
    stream = _stream(trainer, tokenizer, records)
    stream.add(samples[:GROUP])
    assert not stream.covers(samples)
    with pytest.raises(ValueError, match="streamed 4 samples but the step has 8"):
        stream.finish(samples, [0.0] * len(samples))
    stream.add(samples[GROUP:])
    with pytest.raises(RuntimeError, match="differs from the step's"):
        stream.finish(samples, [5.0] * len(samples))
    assert trainer.step == 0


def test_a_group_mixing_prompts_is_rejected_and_abandon_restores_the_trainer():
    trainer, tokenizer = _trainer()
    records, samples = _step_data(tokenizer)
    stream = _stream(trainer, tokenizer, records)
    with pytest.raises(ValueError, match="one prompt's samples"):
        stream.add(samples[GROUP - 1 : GROUP + 1])
    stream.abandon()
    assert not trainer.accumulating


def _thread_counts_of_a_consumer_started_after_an_engine() -> list[int]:
    """In a fresh process (an in-process vLLM engine of an earlier test caps this one's threads):
    the trainer's thread begins a step at 2 threads, an engine's thread sets 1, then a new
    consumer thread adds a group; returns its count before and after."""
    import threading

    torch.set_num_threads(2)
    trainer, tokenizer = _trainer()
    records, samples = _step_data(tokenizer)
    stream = _stream(trainer, tokenizer, records)
    engine = threading.Thread(target=torch.set_num_threads, args=(1,))  # the co-located engine's
    engine.start()
    engine.join()
    seen = []

    def consumer() -> None:
        seen.append(torch.get_num_threads())
        stream.add(samples[:GROUP])
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=consumer)
    thread.start()
    thread.join()
    return seen


def test_groups_accumulate_with_the_trainers_threads_in_a_thread_started_after_an_engines():
    """With torch's OpenMP backend a new thread starts with the intra-op thread count some other
    thread set last: the rollout's consumer thread, started after a co-located engine's thread set
    1, would train on one core."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        seen = pool.apply(_thread_counts_of_a_consumer_started_after_an_engine)
    assert seen == [1, 2]  # the new thread started at the engine's count; the group trained at 2
