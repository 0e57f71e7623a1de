"""Held-out evaluation: exact-match accuracy of a policy on problems, through a generation engine
(prompts encoded by `rl.prompts.encode_prompt`). With an environment each problem is a trajectory:
the engine writes a turn, the environment answers it (a tool's result is appended as its tokens,
rendered once), until the environment is done, `max_turns` or the token budget; a trajectory is
correct when the environment's terminal reward is positive (without one: the last turn's exact
match), as the rollout scores it. One whose environment raises is left out of the mean (an
infrastructure failure, never a wrong answer)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from rl.config import PromptConfig
from rl.environments.protocol import Environment, StepKey
from rl.environments.registry import EnvironmentFactory
from rl.environments.tool_calls import ToolFormat, make_tool_format
from rl.generation import GenerationEngine, GenerationRequest, SamplingParams
from rl.problems import Problem
from rl.prompts import encode_prompt
from rl.rewards import exact_match_reward

log = logging.getLogger("rlboost.evaluation")


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
    environment: EnvironmentFactory | None = None,
    max_turns: int = 1,
) -> float:
    """Mean exact match over `problems` x `samples_per_problem` responses, prompts encoded and
    responses stopped as `prompt` says (`engine` must apply stop strings: `rl.stops.StopStrings`);
    with `environment`, each response is a trajectory of at most `max_turns` model turns."""
    tool_format = make_tool_format(prompt.chat_template, tokenizer) if environment and environment.uses_tools else None
    stop = (*prompt.stop, *(s for s in (tool_format.stop if tool_format else ()) if s not in prompt.stop))
    if stop and not sampling.stop:
        sampling = replace(sampling, stop=stop)
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
    answered = [problem for problem in problems for _ in range(samples_per_problem)]
    if environment is None:
        results = engine.generate(requests)
        texts = [tokenizer.decode(result.token_ids, skip_special_tokens=True) for result in results]
        return sum(exact_match_reward(text, problem.answer) for text, problem in zip(texts, answered)) / len(requests)
    envs = [environment.create(tool_format) for _ in requests]
    try:
        for env, problem in zip(envs, answered):
            env.reset(problem.prompt, problem.answer, None)
        correct = _trajectories(engine, tokenizer, requests, answered, envs, tool_format, max_turns)
    finally:
        for env in envs:
            env.close()
    scored = [ok for ok in correct if ok is not None]
    return sum(scored) / len(scored) if scored else 0.0


def _trajectories(
    engine: GenerationEngine,
    tokenizer,
    requests: list[GenerationRequest],
    problems: Sequence[Problem],
    envs: Sequence[Environment],
    tool_format: ToolFormat | None,
    max_turns: int,
) -> list[bool | None]:
    """Whether each request's trajectory is correct (None: its environment raised): turns generated
    together (the engine batches the live trajectories' turns), each answered by its environment."""
    correct: list[bool | None] = [False] * len(requests)
    live = list(range(len(requests)))
    for turn in range(max_turns):
        following = []
        for i, result in zip(live, engine.generate([requests[i] for i in live])):
            request = requests[i]
            text = tokenizer.decode(result.token_ids[request.turn_start :], skip_special_tokens=True)
            correct[i] = exact_match_reward(text, problems[i].answer) > 0  # unless the environment says
            if result.finish_reason == "length":
                continue  # the budget ended the turn: truncated
            try:
                answer = envs[i].step(text, StepKey(request.sample_id, turn))
            except Exception:
                log.warning("evaluation: the environment of %s failed", request.sample_id, exc_info=True)
                correct[i] = None
                continue
            if answer.done:
                correct[i] = answer.reward > 0 if answer.reward is not None else correct[i]
                continue
            observation = answer.observation or ""
            if tool_format is not None:
                segment = tool_format.encode(observation, tokenizer)
            else:
                segment = list(tokenizer.encode(observation, add_special_tokens=False))
            response = [*result.token_ids, *segment]
            if len(response) < request.max_new_tokens and turn + 1 < max_turns:
                requests[i] = replace(request, generated_ids=response, turn_start=len(response))
                following.append(i)
        live = following
    return correct
