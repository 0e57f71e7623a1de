"""Multi-turn trajectories for the simulator (a scenario's `agentic` section; docs/simulator.md,
"Agentic RL"; the figures' sources: docs/CALIBRATION.md, "Agentic workload").

A trajectory is one sample of turns: the model generates a turn, the environment runs the tool
call it ends with (a latency, no GPU) and appends the result's tokens to the context, and the next
turn continues after them, until the last turn (no tool call after it) or the context budget.
`trajectories` draws one step's plans, the same in every variant (seeded like the response
lengths); `decode_work` is what a plan costs a decode engine at best, for the work bound.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

from infra.sim.scenario import AgenticSection, Scenario


@dataclass(frozen=True)
class Trajectory:
    """One trajectory's plan: model tokens per turn, and after every turn but the last the tool
    call's latency and the tokens of its result."""

    turn_tokens: tuple[int, ...]
    observation_tokens: tuple[int, ...]
    tool_s: tuple[float, ...]

    def __post_init__(self) -> None:
        gaps = len(self.turn_tokens) - 1
        if gaps < 0 or len(self.observation_tokens) != gaps or len(self.tool_s) != gaps:
            raise ValueError("a trajectory needs >= 1 turn and one tool call between two turns")

    @cached_property
    def ends(self) -> tuple[int, ...]:
        """Model tokens generated when each turn ends (cumulative)."""
        return tuple(accumulate(self.turn_tokens))

    @property
    def model_tokens(self) -> int:
        return sum(self.turn_tokens)

    def observed_before(self, turn: int) -> int:
        """Tokens of the tool results appended before turn `turn` (0-based)."""
        return sum(self.observation_tokens[:turn])

    def tools_before(self, turn: int) -> float:
        """Seconds of the tool calls made before turn `turn`: what replaying them costs."""
        return sum(self.tool_s[:turn])


def _lognormal(rng: random.Random, mean: float, cv: float) -> float:
    sigma2 = math.log(1 + cv**2)
    return rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))


def draw(rng: random.Random, agentic: AgenticSection, prompt_tokens: int) -> Trajectory:
    """One trajectory: its number of turns, each turn's tokens, each tool call's latency and result;
    cut where its context (prompt, turns and results) reaches `max_context_tokens`."""
    a = agentic
    turns = max(1, min(a.max_turns, round(_lognormal(rng, a.turns_mean, a.turns_cv))))
    tokens: list[int] = []
    observed: list[int] = []
    tools: list[float] = []
    context = prompt_tokens
    for turn in range(turns):
        n = max(1, min(a.max_turn_tokens, round(_lognormal(rng, a.turn_tokens_mean, a.turn_tokens_cv))))
        n = min(n, a.max_context_tokens - context)
        tokens.append(n)
        context += n
        obs = max(1, round(_lognormal(rng, a.observation_tokens_mean, a.observation_tokens_cv)))
        tool = _lognormal(rng, a.tool_latency_mean_s, a.tool_latency_cv)
        if turn == turns - 1 or context + obs >= a.max_context_tokens:
            break  # the last turn, or the budget: the trajectory is truncated here
        observed.append(obs)
        tools.append(tool)
        context += obs
    return Trajectory(tuple(tokens), tuple(observed), tuple(tools))


def trajectories(scenario: Scenario, step: int) -> list[Trajectory]:
    """The plans of `step`'s samples, group by group (the same in every variant)."""
    agentic, w = scenario.agentic, scenario.workload
    if agentic is None:
        raise ValueError("the scenario has no agentic section")
    rng = random.Random(f"{scenario.seed}/trajectories/{step}")
    return [draw(rng, agentic, w.prompt_tokens) for _ in range(w.prompts_per_step * w.samples_per_prompt)]


@dataclass(frozen=True)
class DecodeWork:
    """What samples cost a decode engine at best: model tokens, their summed context (each token
    reads the KV of every token before it), and the tokens prefilled once (prompts, tool results)."""

    tokens: float
    context_tokens: float
    prefill_tokens: float


def decode_work(prompt_tokens: int, samples: Iterable[tuple[int, ...] | Trajectory]) -> DecodeWork:
    """`DecodeWork` of single-turn responses (a one-element tuple: the length) or trajectories."""
    tokens = context = prefill = 0.0
    for sample in samples:
        turns = sample.turn_tokens if isinstance(sample, Trajectory) else sample
        observed = sample.observation_tokens if isinstance(sample, Trajectory) else ()
        start = prompt_tokens
        for turn, n in enumerate(turns):
            tokens += n
            context += n * start + n * n / 2
            start += n + (observed[turn] if turn < len(observed) else 0)
        prefill += prompt_tokens + sum(observed)
    return DecodeWork(tokens, context, prefill)
