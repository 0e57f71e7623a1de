"""Held-out evaluation: exact-match accuracy of a policy on problems, through a generation engine
(prompts encoded by `rl.prompts.encode_prompt`). With an environment each problem is a trajectory:
the engine writes a turn, the environment answers it (a tool's result is appended as its tokens,
rendered once), until the environment is done, `max_turns` or the token budget; a trajectory is
correct when the environment's terminal reward is positive (without one: the last turn's exact
match), as the rollout scores it. One whose environment raises is left out of the mean (an
infrastructure failure, never a wrong answer).

`evaluate_pass_at_k` draws `eval.samples` responses per problem with the sample ids and seeds the
rollout fabric gives an evaluation's groups (`evaluation_requests`: step `step`, group = problem),
so the keyed sampler draws the same tokens in process and on the fabric's instances, preempted or
not, and returns pass@k and avg@k (`rl.pass_at_k`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from rl.config import EvalConfig, PromptConfig
from rl.environments.protocol import Environment, StepKey
from rl.environments.registry import EnvironmentFactory
from rl.environments.tool_calls import ToolFormat, make_tool_format
from rl.generation import GenerationEngine, GenerationRequest, SamplingParams
from rl.pass_at_k import Estimates, estimate
from rl.problems import Problem
from rl.prompts import encode_prompt
from rl.rewards import exact_match_reward
from rl.rollout import Sample, step_seed

EVAL_SEED_OFFSET = 7919
"""An evaluation's seed is `run.seed` + this (its noise is never a training step's)."""


def eval_seed(run_seed: int) -> int:
    """The run seed of an evaluation's keyed sampling (`step_seed(eval_seed(run_seed), step)` per step)."""
    return run_seed + EVAL_SEED_OFFSET


def eval_sampling(config: EvalConfig, prompt: PromptConfig) -> SamplingParams:
    """How an evaluation samples: at `eval.temperature`, no top-k or top-p, stopping at `prompt.stop`."""
    return SamplingParams(temperature=config.temperature, stop=prompt.stop)


def evaluation_requests(
    tokenizer,
    problems: Sequence[Problem],
    step: int,
    samples: int,
    max_new_tokens: int,
    sampling: SamplingParams,
    run_seed: int,
    prompt: PromptConfig = PromptConfig(),
) -> list[GenerationRequest]:
    """`samples` requests per problem, as the rollout fabric names and seeds the samples of a step
    `step` whose groups are the problems: ids `<step>/<problem>/<index>`, seed
    `step_seed(run_seed, step)` (give `eval_seed(run.seed)`)."""
    seed = step_seed(run_seed, step)
    requests = []
    for group, problem in enumerate(problems):
        prompt_ids = encode_prompt(tokenizer, problem.prompt, prompt)
        requests += [
            GenerationRequest(f"{step}/{group}/{index}", prompt_ids, max_new_tokens, seed=seed, sampling=sampling)
            for index in range(samples)
        ]
    return requests


def response_correct(text: str, answer: str, env_reward: float | None) -> bool:
    """Whether a response is correct: its environment's terminal reward is positive, or without one
    its (last turn's) answer matches exactly."""
    return env_reward > 0 if env_reward is not None else exact_match_reward(text, answer) > 0


def sample_correct(sample: Sample, answer: str, tokenizer) -> bool:
    """Whether a rollout's sample (the fabric's) is correct as `evaluate_pass_at_k` scores the same
    sample in process: its environment's terminal reward, else its last model turn's text (a
    trajectory's earlier turns and observations are not its answer, as in `rl.scoring`)."""
    start, end, _ = sample.model_turns()[-1]
    text = tokenizer.decode(sample.response_ids[start:end], skip_special_tokens=True)
    return response_correct(text, answer, sample.env_reward)


def evaluate_pass_at_k(
    engine: GenerationEngine,
    tokenizer,
    problems: Sequence[Problem],
    config: EvalConfig,
    *,
    step: int,
    max_new_tokens: int,
    run_seed: int,
    prompt: PromptConfig = PromptConfig(),
    environment: EnvironmentFactory | None = None,
    max_turns: int = 1,
) -> Estimates:
    """pass@k for each `config.k` and avg@k of the policy in `engine` on `problems`, from
    `config.samples` responses each drawn as the fabric would for an evaluation step `step`."""
    requests = evaluation_requests(
        tokenizer,
        problems,
        step,
        config.samples,
        max_new_tokens,
        eval_sampling(config, prompt),
        eval_seed(run_seed),
        prompt,
    )
    correct = _correct(engine, tokenizer, problems, requests, config.samples, prompt, environment, max_turns)
    return estimate(correct, config.k)


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
    encoded = [encode_prompt(tokenizer, problem.prompt, prompt) for problem in problems]
    requests = [
        GenerationRequest(
            sample_id=f"eval-{i}-{j}",
            prompt_ids=encoded[i],
            max_new_tokens=max_new_tokens,
            seed=seed,
            sampling=sampling,
        )
        for i in range(len(problems))
        for j in range(samples_per_problem)
    ]
    correct = _correct(engine, tokenizer, problems, requests, samples_per_problem, prompt, environment, max_turns)
    return estimate(correct, [1]).avg_at_k


def _correct(
    engine: GenerationEngine,
    tokenizer,
    problems: Sequence[Problem],
    requests: list[GenerationRequest],
    samples: int,
    prompt: PromptConfig,
    environment: EnvironmentFactory | None,
    max_turns: int,
) -> list[list[bool | None]]:
    """Whether each of the `samples` consecutive requests of each problem was answered correctly
    (None: its environment failed); the prompt's stop strings (and the tool format's) are added to
    each request's sampling unless it has its own."""
    tool_format = make_tool_format(prompt.chat_template, tokenizer) if environment and environment.uses_tools else None
    stop = (*prompt.stop, *(s for s in (tool_format.stop if tool_format else ()) if s not in prompt.stop))
    requests = [
        r if r.sampling.stop or not stop else replace(r, sampling=replace(r.sampling, stop=stop)) for r in requests
    ]
    answered = [problem for problem in problems for _ in range(samples)]
    if environment is None:
        results = engine.generate(requests)
        texts = [tokenizer.decode(result.token_ids, skip_special_tokens=True) for result in results]
        flat: list[bool | None] = [response_correct(t, p.answer, None) for t, p in zip(texts, answered)]
    else:
        envs = [environment.create(tool_format) for _ in requests]
        try:
            for env, problem in zip(envs, answered):
                env.reset(problem.prompt, problem.answer, None)
            flat = _trajectories(engine, tokenizer, requests, answered, envs, tool_format, max_turns)
        finally:
            for env in envs:
                env.close()
    return [flat[i * samples : (i + 1) * samples] for i in range(len(problems))]


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
