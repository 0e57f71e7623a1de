"""Supervised pretraining of the tiny base model on arithmetic, stopped on held-out accuracy.

The model learns ``prompt -> solution<eos>`` with the loss on the solution tokens only. Held-out
greedy exact match stays near zero for hundreds of steps and then jumps; a fixed step count would
either stop before the jump or train far past it (leaving RL nothing to do), so training stops
as soon as the held-out accuracy reaches `PretrainConfig.accuracy_threshold`.

With `corpus_error_rate > 0` a fraction of the training solutions carry one wrong digit, like
mistakes in real pretraining text (the calculator's: in the expression it passes to the tool, or
in the answer it copies from the result; a tool's result is the environment's text, never a
target: its tokens are masked out of the loss, and the held-out evaluation runs the tool). The model still learns the right answer as its most likely
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
from rl.environments import calculator
from rl.environments.registry import EnvironmentFactory, environment_path
from rl.environments.tool_calls import TextToolFormat
from rl.evaluation import evaluate_accuracy
from rl.families import environment_of, eval_set, problem_stream
from rl.generation import GenerationEngine, SamplingParams
from rl.models import TinyLlamaShape, build_tiny_llama, save_model
from rl.optimizer import adamw
from rl.problems import Problem
from rl.stops import StopStrings


@dataclass(frozen=True)
class PretrainResult:
    steps: int
    accuracy: float
    seconds: float
    history: tuple[tuple[int, float, float], ...]
    """(step, training loss, held-out greedy accuracy) at each evaluation."""


class ThresholdNotReached(RuntimeError):
    pass


PRETRAIN_EVAL_TURNS = 4
"""Model turns of a held-out trajectory in pretraining's evaluation (a calculator solution has 2)."""


def corrupt_solution(solution: str, rng: random.Random) -> str:
    """The solution with one digit of its final number replaced by a different digit."""
    digits = [i for i, ch in enumerate(solution) if ch.isdigit()]
    tail_start = len(solution) - len(solution.rsplit("=", 1)[-1])
    position = rng.choice([i for i in digits if i >= tail_start])
    wrong = rng.choice([d for d in "0123456789" if d != solution[position]])
    return solution[:position] + wrong + solution[position + 1 :]


def target_segments(problem: Problem, rng: random.Random, error_rate: float) -> list[tuple[str, bool]]:
    """The supervised target of `problem` as (text, trained) segments: the solution (with one
    wrong digit with probability `error_rate`); a calculator problem's demonstration is its turns,
    each tool result between them untrained (the environment writes it, as in a trajectory)."""
    if problem.family != calculator.FAMILY:
        return [(corrupt_solution(problem.solution, rng) if rng.random() < error_rate else problem.solution, True)]
    segments = []
    for turn in calculator.demonstration(problem, rng, error_rate):
        segments.append((turn.text, True))
        if turn.observation is not None:
            segments.append((TextToolFormat().render(turn.observation), False))
    return segments


def _supervised_batch(
    tokenizer, problems: list[Problem], error_rate: float, rng: random.Random
) -> dict[str, torch.Tensor]:
    rows, labels = [], []
    for problem in problems:
        prompt = tokenizer(problem.prompt).input_ids
        row, label = list(prompt), [-100] * len(prompt)
        for text, trained in target_segments(problem, rng, error_rate):
            ids = tokenizer(text, add_special_tokens=False).input_ids
            row += ids
            label += ids if trained else [-100] * len(ids)
        rows.append(row + [tokenizer.eos_token_id])
        labels.append(label + [tokenizer.eos_token_id])
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


def _held_out_accuracy(engine: GenerationEngine, tokenizer, family: str, problems: list[Problem]) -> float:
    """Greedy accuracy on `family`'s held-out problems (a tool family's: trajectories in its environment)."""
    environment = environment_of(family)
    return evaluate_accuracy(
        engine,
        tokenizer,
        problems,
        max_new_tokens=max_response_tokens(problems),
        sampling=SamplingParams(greedy=True),
        environment=EnvironmentFactory(environment_path(environment, None)) if environment else None,
        max_turns=PRETRAIN_EVAL_TURNS,
    )


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
    engine = StopStrings(
        HFEngine(model, eos_id, pad_id, max_batch_size=256, device=next(model.parameters()).device), tokenizer
    )
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
            _held_out_accuracy(engine, tokenizer, family, family_problems)
            for family, family_problems in held_out.items()
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
