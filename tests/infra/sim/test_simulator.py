"""A small scenario end to end (seconds): every variant conserves samples and tokens, costs are
sane, and the runtime's own policies drive it (a change of their configuration changes the run)."""

from __future__ import annotations

import pytest

from infra.sim import claiming, simulator
from infra.sim.availability import spot_schedule
from infra.sim.runner import compare
from infra.sim.scenario import Scenario, parse_scenario, prices_per_hour
from infra.sim.simulator import Simulation

SMALL = """
name: small
seed: 3
workload: {prompts_per_step: 6, samples_per_prompt: 4, prompt_tokens: 64, mean_response_tokens: 600,
           response_cv: 1.0, max_response_tokens: 2048}
reserved: {gpus: 2, engine_gpus: 1, max_running: 8, price_per_hour: 8}
spot: {gpus: 1, max_running: 8, max_instances: 3, price_per_hour: 2, ondemand_price_per_hour: 10, boot_s: 5,
       silent_fraction: 0.5}
availability: {source: trace, trace: bamboo/p3, time_compression: 60}
controller: {offload: {initial_t_local_s: 5}, reap_timeout_s: 5, poll_s: 0.5}
run: {duration_s: 900}
"""


def merged(base: dict, changes: dict) -> dict:
    return {
        k: merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
        for k, v in {**base, **changes}.items()
    }


def small(**sections) -> Scenario:
    """The small scenario with some fields changed (validated again)."""
    return Scenario.model_validate(merged(parse_scenario(SMALL).model_dump(), sections))


@pytest.fixture(scope="module")
def comparison():
    return compare(small())


def test_every_sample_is_generated_once_and_every_token_is_trained_or_wasted(comparison):
    for name, result in comparison.results.items():
        assert result.samples_done == result.samples_total > 0, name
        # with bounded staleness the steps admitted but not trained at the end hold the rest
        assert (result.open_samples > 0) == (result.max_staleness > 0), name
        assert result.generated_tokens == pytest.approx(
            result.trained_response_tokens + result.wasted_tokens + result.open_tokens
        ), name
        assert result.wasted_tokens >= 0, name
        assert sum(s.trained_tokens for s in result.steps) == pytest.approx(
            result.trained_response_tokens + 64 * result.samples_total
        ), name


def test_costs_are_positive_and_ratios_are_against_on_demand(comparison):
    metrics = comparison.metrics
    assert metrics["ondemand"].throughput_ratio == 1.0 and metrics["ondemand"].cost_efficiency_gain == 0.0
    for name, m in metrics.items():
        assert m.cost_usd > 0 and m.usd_per_m_tokens > 0 and m.tokens_per_s > 0, name
        assert 0 <= m.spot_idle_fraction <= 1 and 0 <= m.trainer_idle_fraction <= 1, name
    equal, rlboost = metrics["ondemand_equal_cost"], metrics["rlboost"]
    assert equal.reserved_gpus > metrics["ondemand"].reserved_gpus
    assert equal.cost_usd / equal.wall_s <= rlboost.cost_usd / rlboost.wall_s  # whole engines, never more


def test_preemptions_cost_tokens_only_as_each_mode_says(comparison):
    results = comparison.results
    assert results["ondemand"].preemptions == 0 and results["ondemand"].wasted_tokens == 0
    assert results["rlboost"].preemptions > 0 and results["rlboost"].silent_kills > 0
    # the token log loses only unflushed tails of silent kills; restart loses whole samples
    assert 0 < results["rlboost"].wasted_tokens < results["restart"].wasted_tokens


def test_on_demand_never_releases_and_spot_variants_do(comparison):
    assert all(s.t_local_s is None and s.trainer_idle_s == 0 for s in comparison.results["ondemand"].steps)
    assert any(s.t_local_s is not None for s in comparison.results["rlboost"].steps)


def run(scenario: Scenario, variant: str = "rlboost"):
    from infra.sim.runner import SPECS

    return Simulation(scenario, SPECS[variant], spot_schedule(scenario), prices_per_hour(scenario)[:2]).run()


def test_the_offload_controllers_config_drives_t_local():
    base = [s.t_local_s for s in run(small()).steps]
    damped = [s.t_local_s for s in run(small(controller={"offload": {"initial_t_local_s": 5, "damping": 30}})).steps]
    later = [s.t_local_s for s in run(small(controller={"offload": {"initial_t_local_s": 12}})).steps]
    assert base != damped and base != later
    assert next(t for t in later if t is not None) == 12


def test_the_runtime_policies_decide_and_the_token_logs_order_claims(monkeypatch):
    """reap and steal are the runtime's; dispatch (the simulator's model of concurrent claims)
    shares the queue out, which pops in `claim_key` order (the token log's, test_claim_order.py)."""
    calls: dict[str, int] = {"reap": 0, "steal": 0, "dispatch": 0, "claim_key": 0}
    for module, name in [(simulator, "reap"), (simulator, "steal"), (simulator, "dispatch"), (claiming, "claim_key")]:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            decisions = _real(*args, **kwargs)
            calls[_name] += len(decisions)
            return decisions

        monkeypatch.setattr(module, name, counted)
    result = run(small(spot={"silent_fraction": 1.0}))
    assert result.silent_kills > 0
    assert all(count > 0 for count in calls.values()), calls


MEASURED = {
    "decode_step_s": 0.004,
    "decode_s_per_context_token": 1e-6,
    "prefill_s_per_token": 1e-5,
    "train_s_per_token": 2e-4,
    "cores": 2,
    "busy_processes": 2,
}


def test_a_measured_profile_replaces_the_gpu_models_and_sharing_cores_stretches_it():
    fast = run(small(measured=MEASURED, run={"max_steps": 3, "duration_s": 10_000}), "ondemand")
    shared = run(
        small(measured={**MEASURED, "busy_processes": 4}, run={"max_steps": 3, "duration_s": 10_000}), "ondemand"
    )
    gpu = run(small(run={"max_steps": 3, "duration_s": 10_000}), "ondemand")
    assert [s.rollout_s for s in fast.steps] != [s.rollout_s for s in gpu.steps]
    for a, b in zip(
        fast.steps, shared.steps
    ):  # twice the processes on the cores: every measured time doubles (claim delays do not)
        assert b.train_s == pytest.approx(2 * a.train_s) and 1.8 * a.rollout_s < b.rollout_s < 2 * a.rollout_s
    trained = sum(s.trained_tokens for s in fast.steps)
    assert sum(s.train_s for s in fast.steps) == pytest.approx(trained * MEASURED["train_s_per_token"])


def test_training_while_generating_overlaps_the_rollout():
    sections = {"measured": MEASURED, "run": {"max_steps": 3, "duration_s": 10_000}}
    serial = run(small(**sections), "ondemand")
    overlapped = run(small(**sections, training={"while_generating": True}), "ondemand")
    assert sum(s.trained_tokens for s in overlapped.steps) == sum(s.trained_tokens for s in serial.steps)
    for a, b in zip(serial.steps, overlapped.steps):
        assert a.ended_at - a.started_at == pytest.approx(a.rollout_s + a.train_s, rel=0.01)  # one, then the other
        assert b.ended_at - b.started_at < a.ended_at - a.started_at


def test_the_step_overhead_follows_the_last_trained_group_and_leaves_the_offload_timing_alone():
    sections = {"run": {"max_steps": 4, "duration_s": 10_000}, "availability": {"source": "constant"}}
    plain = run(small(**sections), "rlboost")
    overhead = run(small(**sections, training={"step_overhead_s": 7.0}), "rlboost")
    for a, b in zip(plain.steps, overhead.steps):
        assert b.ended_at - b.started_at == pytest.approx(a.ended_at - a.started_at + 7.0, abs=0.6)
        # what the offload controller is told is measured up to the last trained group, so
        # T_local moves as it does without the overhead (the polls' grid may shift by one poll)
        assert b.trainer_idle_s == pytest.approx(a.trainer_idle_s, abs=0.6)
        assert b.t_local_s == pytest.approx(a.t_local_s, abs=0.6)


def test_a_micro_batch_of_the_whole_step_trains_only_once_every_group_is_complete():
    sections = {"measured": MEASURED, "run": {"max_steps": 3, "duration_s": 10_000}}
    streamed = {"while_generating": True}
    per_group = run(small(**sections, training=streamed), "ondemand")
    whole_step = run(small(**sections, training={**streamed, "micro_batch_samples": 6 * 4}), "ondemand")
    pairs = run(small(**sections, training={**streamed, "micro_batch_samples": 8}), "ondemand")
    for a, b, c in zip(per_group.steps, whole_step.steps, pairs.steps):
        assert a.trained_tokens == b.trained_tokens == c.trained_tokens
        assert b.ended_at - b.started_at == pytest.approx(b.rollout_s + b.train_s, rel=0.01)  # one, then the other
        assert a.ended_at - a.started_at < c.ended_at - c.started_at < b.ended_at - b.started_at
