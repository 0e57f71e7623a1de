"""Held-out evaluation: exact-match accuracy of a policy on problems, through a generation engine
(prompts encoded by `rl.prompts.encode_prompt`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from rl.config import PromptConfig
from rl.generation import GenerationEngine, GenerationRequest, SamplingParams
from rl.problems import Problem
from rl.prompts import encode_prompt
from rl.rewards import exact_match_reward


def evaluate_accuracy(
    engine: GenerationEngine,
    tokenizer,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    samples_per_problem: int = 1,
    seed: int = 0,
    prompt: PromptConfig = PromptConfig(),
) -> float:
    """Mean exact match over `problems` x `samples_per_problem` responses, prompts encoded and
    responses stopped as `prompt` says (`engine` must apply stop strings: `rl.stops.StopStrings`)."""
    if prompt.stop and not sampling.stop:
        sampling = replace(sampling, stop=prompt.stop)
    encoded = [encode_prompt(tokenizer, problem.prompt, prompt) for problem in problems]
    requests = [
        GenerationRequest(
            sample_id=f"eval-{i}-{j}",
            prompt_ids=encoded[i],
            max_new_tokens=max_new_tokens,
            seed=seed,
            sampling=sampling,
        )
        for i, problem in enumerate(problems)
        for j in range(samples_per_problem)
    ]
    results = engine.generate(requests)
    correct = sum(
        exact_match_reward(tokenizer.decode(result.token_ids, skip_special_tokens=True), problem.answer)
        for result, problem in zip(results, (p for p in problems for _ in range(samples_per_problem)))
    )
    return correct / len(requests)
