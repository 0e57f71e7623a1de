"""Supervised pretraining of the tiny base model on arithmetic, stopped on held-out accuracy.

The model learns ``prompt -> solution<eos>`` with the loss on the solution tokens only. Held-out
greedy exact match stays near zero for hundreds of steps and then jumps; a fixed step count would
either stop before the jump or train far past it (leaving RL nothing to do), so training stops
as soon as the held-out accuracy reaches `PretrainConfig.accuracy_threshold`.

With `corpus_error_rate > 0` a fraction of the training solutions carry one wrong digit, like
mistakes in real pretraining text. The model still learns the right answer as its most likely
output (greedy accuracy, which the threshold measures), but it also learns to sample the
mistakes at temperature 1: the gap that RL with a verifiable reward closes. This is the demo's
setting; it is a property of the data, not of the RL algorithm, and docs/demo.md says so.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl.config import ModelConfig, PretrainConfig
from rl.engine import HFEngine
from rl.evaluation import evaluate_accuracy
from rl.generation import SamplingParams
from rl.models import TinyLlamaShape, build_tiny_llama, save_model
from rl.optimizer import adamw
from rl.problems import Problem, eval_set, problem_stream


@dataclass(frozen=True)
class PretrainResult:
    steps: int
    accuracy: float
    seconds: float
    history: tuple[tuple[int, float, float], ...]
    """(step, training loss, held-out greedy accuracy) at each evaluation."""


class ThresholdNotReached(RuntimeError):
    pass


def corrupt_solution(solution: str, rng: random.Random) -> str:
    """The solution with one digit of its final number replaced by a different digit."""
    digits = [i for i, ch in enumerate(solution) if ch.isdigit()]
    tail_start = len(solution) - len(solution.rsplit("=", 1)[-1])
    position = rng.choice([i for i in digits if i >= tail_start])
    wrong = rng.choice([d for d in "0123456789" if d != solution[position]])
    return solution[:position] + wrong + solution[position + 1 :]


def _supervised_batch(
    tokenizer, problems: list[Problem], error_rate: float, rng: random.Random
) -> dict[str, torch.Tensor]:
    rows, labels = [], []
    for problem in problems:
        prompt = tokenizer(problem.prompt).input_ids
        solution = corrupt_solution(problem.solution, rng) if rng.random() < error_rate else problem.solution
        target = tokenizer(solution, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    label_ids = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, label) in enumerate(zip(rows, labels)):
        input_ids[i, : len(row)] = torch.tensor(row)
        label_ids[i, : len(row)] = torch.tensor(label)
        attention[i, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention, "labels": label_ids}


def max_response_tokens(problems: list[Problem]) -> int:
    return max(len(p.solution) for p in problems) + 1


def pretrain(
    config: PretrainConfig,
    shape: ModelConfig,
    on_eval: Callable[[int, float, float], None] | None = None,
    threads: int | None = None,
) -> PretrainResult:
    """Train a fresh tiny Llama until held-out greedy accuracy >= threshold; save it.

    `threads` sets torch's CPU threads first (`run.torch_threads`; None keeps torch's choice).
    """
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = build_tiny_llama(
        TinyLlamaShape(shape.hidden_size, shape.num_layers, shape.num_heads, shape.intermediate_size),
        seed=config.seed,
    )
    optimizer = adamw(model.parameters(), lr=config.lr, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / (config.warmup_steps + 1))
    )
    streams = [problem_stream(family, config.seed) for family in config.families]
    mixed = (next(stream) for stream in itertools.cycle(streams))
    held_out = {family: eval_set(family, config.eval_size) for family in config.families}
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(eos_id, int) and isinstance(pad_id, int), "the character tokenizer has <eos> and <pad>"
    engine = HFEngine(model, eos_id, pad_id, max_batch_size=256, device=next(model.parameters()).device)
    noise_rng = random.Random(config.seed)
    history: list[tuple[int, float, float]] = []
    start = time.perf_counter()
    for step in range(1, config.max_steps + 1):
        model.train()
        problems = list(itertools.islice(mixed, config.batch_size))
        batch = _supervised_batch(tokenizer, problems, config.corpus_error_rate, noise_rng)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % config.eval_every and step != config.max_steps:
            continue  # (the last step is always evaluated: it may reach the threshold)
        model.eval()
        accuracy = sum(
            evaluate_accuracy(
                engine,
                tokenizer,
                family_problems,
                max_new_tokens=max_response_tokens(family_problems),
                sampling=SamplingParams(greedy=True),
            )
            for family_problems in held_out.values()
        ) / len(held_out)
        history.append((step, loss.item(), accuracy))
        if on_eval:
            on_eval(step, loss.item(), accuracy)
        if accuracy >= config.accuracy_threshold:
            save_model(model, tokenizer, config.output)
            return PretrainResult(step, accuracy, time.perf_counter() - start, tuple(history))
    raise ThresholdNotReached(
        f"held-out accuracy {history[-1][2]:.2f} < threshold {config.accuracy_threshold} after "
        f"{config.max_steps} steps; raise pretrain.max_steps or lower pretrain.accuracy_threshold"
    )
