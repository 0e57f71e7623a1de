"""Multi-turn trajectories in the simulator (`agentic` section): the plans respect their bounds and
are the same in every variant; every variant conserves samples and tokens; this project's
migration keeps a trajectory and its environment where `restart` starts it over and re-runs its
tools; a prefix cache saves prefill; no variant beats the work bound, and the bound at the KV
cache's batch is never above it."""

from __future__ import annotations

import random

import pytest

from infra.run.config import ConfigError
from infra.sim.agentic import Trajectory, decode_work, draw, trajectories
from infra.sim.runner import compare, step_work
from infra.sim.scenario import AgenticSection, parse_scenario
from tests.infra.sim.test_simulator import run, small

AGENTIC = {
    "turns_mean": 6,
    "turn_tokens_mean": 100,
    "observation_tokens_mean": 80,
    "tool_latency_mean_s": 2.0,
    "max_context_tokens": 2048,
}
VARIANTS = ("rlboost", "restart", "paper", "rlboost_async_k1", "rlboost_async_k2")


def agentic(**changes):
    return small(agentic={**AGENTIC, **changes.pop("agentic", {})}, **changes)


@pytest.fixture(scope="module")
def comparison():
    return compare(agentic(run={"variants": VARIANTS}))


def test_a_plan_stays_within_its_turns_and_context_budget():
    section = AgenticSection(**AGENTIC, max_turns=9)
    rng = random.Random(0)
    for _ in range(300):
        plan = draw(rng, section, 64)
        assert 1 <= len(plan.turn_tokens) <= 9
        assert len(plan.observation_tokens) == len(plan.tool_s) == len(plan.turn_tokens) - 1
        assert 64 + plan.model_tokens + sum(plan.observation_tokens) <= 2048
        assert plan.ends[-1] == plan.model_tokens and all(n >= 1 for n in plan.turn_tokens)
    with pytest.raises(ValueError):
        Trajectory((5, 5), (), ())


def test_a_step_draws_the_same_plans_whatever_the_variant():
    scenario = agentic()
    assert trajectories(scenario, 3) == trajectories(scenario, 3) != trajectories(scenario, 4)
    assert len(trajectories(scenario, 0)) == 6 * 4
    # the bound's work: a one-turn trajectory costs what a single response of its length does
    one = decode_work(64, [Trajectory((300,), (), ())])
    assert one == decode_work(64, [(300,)])
    two = decode_work(64, [Trajectory((100, 200), (50,), (1.0,))])
    assert two.tokens == 300 and two.prefill_tokens == 64 + 50
    assert two.context_tokens == 100 * 64 + 100**2 / 2 + 200 * (64 + 100 + 50) + 200**2 / 2


def test_every_trajectory_is_trained_once_and_every_token_is_trained_wasted_or_open(comparison):
    scenario = comparison.scenario
    for name, result in comparison.results.items():
        assert result.samples_done == result.samples_total > 0, name
        assert result.generated_tokens == pytest.approx(
            result.trained_response_tokens + result.wasted_tokens + result.open_tokens
        ), name
        # trained tokens are the prompts, every turn and every tool result of the trained steps
        trained = sum(step_work(scenario, s.step)[0] for s in result.steps)
        assert sum(s.trained_tokens for s in result.steps) == pytest.approx(trained), name
        assert result.tool_calls > 0, name


def planned_tool_calls(scenario, steps: range) -> int:
    return sum(len(plan.tool_s) for step in steps for plan in trajectories(scenario, step))


def test_migration_keeps_the_environment_where_restart_starts_over_and_reruns_tools(comparison):
    scenario, results, metrics = comparison.scenario, comparison.results, comparison.metrics
    assert results["restart"].preemptions > 0
    assert metrics["restart"].waste_fraction > metrics["rlboost"].waste_fraction
    # restart re-ran the tool calls of the turns it threw away ...
    assert results["restart"].tool_calls > planned_tool_calls(scenario, range(len(results["restart"].steps)))
    # ... this project never runs one twice (its environment server keeps them), even over the
    # steps admitted but not trained when the run ended
    for name in ("rlboost", "rlboost_async_k1", "rlboost_async_k2"):
        result = results[name]
        assert result.replayed_tool_calls == 0, name
        admitted = range(len(result.steps) + 1 + result.max_staleness)
        assert result.tool_calls <= planned_tool_calls(scenario, admitted), name
    assert results["paper"].replayed_tool_calls > 0  # its environment is rebuilt by replaying


def test_a_replayed_environment_pins_this_projects_trajectories_to_their_instance():
    replay = run(agentic(agentic={"environment": "replay"}), "rlboost")
    server = run(agentic(), "rlboost")
    assert server.replayed_tool_calls == 0 < replay.replayed_tool_calls
    assert replay.samples_done == replay.samples_total > 0


def test_the_prefix_cache_saves_the_history_prefill():
    cached = run(agentic(), "rlboost")
    uncached = run(agentic(agentic={"kv_reuse": False}), "rlboost")
    assert uncached.prefill_tokens > 1.5 * cached.prefill_tokens
    assert cached.samples_done > 0 and uncached.samples_done > 0


def test_no_variant_beats_the_bound_and_the_kv_bound_is_tighter(comparison):
    bound = comparison.bound
    assert bound is not None
    assert 0 < bound.tokens_per_s_kv <= bound.tokens_per_s
    for name, m in comparison.metrics.items():
        assert m.fraction_of_bound is not None and 0 < m.fraction_of_bound < 1, name
    # the tool results are trained tokens: the bound's step holds them
    last = max(len(result.steps) for result in comparison.results.values())
    mean = sum(step_work(comparison.scenario, step)[0] for step in range(last)) / last
    assert bound.tokens_per_step == pytest.approx(mean)


def errors(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_scenario(text, "s.yaml")
    return str(caught.value)


def test_a_bad_agentic_section_names_file_line_field_and_fix():
    message = errors("availability:\n  source: constant\nagentic:\n  max_turns: 0\n")
    assert "s.yaml:4: agentic.max_turns: Input should be greater than or equal to 1 (got 0)" in message
    assert "the field: Most turns of one trajectory" in message
    message = errors(
        "availability:\n  source: constant\nworkload:\n  prompt_tokens: 4096\nagentic:\n  max_context_tokens: 4000\n"
    )
    assert "s.yaml:6: agentic.max_context_tokens: 4,000 leaves no room after workload.prompt_tokens (4,096)" in message
    assert "agentic.environment" in errors("availability:\n  source: constant\nagentic:\n  environment: disk\n")
    scenario = parse_scenario("availability:\n  source: constant\nagentic:\n  turns_mean: 3\n")
    assert scenario.agentic is not None and scenario.agentic.turns_mean == 3
