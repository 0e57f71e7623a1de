"""Bounded staleness in the simulator (`training.max_staleness: K`): K = 0 is today's loop to the
last digit; with K >= 1 rollout of the next steps goes on while the trainer trains, never more
than K versions ahead, and a step takes about max(rollout, training) instead of their sum; this
project's trainer skips the old-log-prob forward; no variant beats the work-conservation bound."""

from __future__ import annotations

from dataclasses import replace

import pytest

from infra.run.config import ConfigError
from infra.sim.availability import spot_schedule
from infra.sim.runner import SPECS, compare, work_bound
from infra.sim.scenario import load_scenario, parse_scenario, prices_per_hour
from infra.sim.simulator import Simulation, cluster_train_seconds
from tests.helpers import REPO_ROOT
from tests.infra.sim.test_simulator import MEASURED, run, small

TODAY = {
    # (scenario, variant): (steps, last step's end, generated tokens, wasted tokens), as the
    # simulator gave them before bounded staleness existed (the old-log-prob forward included),
    # since then claiming in the token log's order (`claims.claim_key`, test_claim_order.py)
    # instead of partial-first-then-FIFO: the variants that requeue samples moved
    ("small", "ondemand"): (49, "911.3960023033079", "709821.9999999997", "0.0"),
    ("small", "rlboost"): (53, "909.3909790242127", "772493.2883963245", "230.28839632460216"),
    ("small", "paper"): (8, "1044.771830131446", "116297.99999999988", "0.0"),
    ("small", "restart"): (35, "901.8545716547371", "610720.4582501403", "101555.45825014032"),
    ("measured", "rlboost"): (27, "411.92044989159257", "401234.4606362973", "100.4606362975428"),
    ("measured", "rlboost_no_steal"): (25, "404.02678233309183", "371638.4538501899", "150.45385018992874"),
}


def scenario_named(name: str, k: int | None = None):
    training = {"while_generating": True, "micro_batch_samples": 8} if name == "measured" else {}
    if k is not None:
        training["max_staleness"] = k
    sections = {"measured": MEASURED, "run": {"duration_s": 400}} if name == "measured" else {}
    return small(training=training, **sections)


@pytest.mark.parametrize(("name", "variant"), sorted(TODAY))
def test_k0_gives_todays_numbers(name, variant):
    spec = replace(SPECS[variant], recompute_logprobs=True)  # today's trainers all recomputed
    for k in (None, 0):  # the field left out, or 0
        scenario = scenario_named(name, k)
        result = Simulation(scenario, spec, spot_schedule(scenario), prices_per_hour(scenario)[:2]).run()
        got = (len(result.steps), repr(result.steps[-1].ended_at), repr(result.generated_tokens))
        assert got + (repr(result.wasted_tokens),) == TODAY[(name, variant)]
        assert result.open_samples == 0 and result.max_staleness == 0
        assert all(s.admitted_at == s.started_at for s in result.steps)


def ideal(**training):
    """Unbounded spot capacity, free weight pulls and loads, no prefill: rollout of a step takes
    ~10 s on the spot instances and training ~10 s on the reserved GPU, which releases at once."""
    return small(
        workload={
            "prompts_per_step": 4,
            "samples_per_prompt": 2,
            "prompt_tokens": 10,
            "mean_response_tokens": 100,
            "response_cv": 0.001,
            "max_response_tokens": 200,
        },
        reserved={"gpus": 1, "max_running": 8},
        spot={"max_instances": 4, "max_running": 8, "boot_s": 0, "silent_fraction": 0.0},
        availability={"source": "constant"},
        network={"trainer_gbps": 1e9, "instance_gbps": 1e9, "local_sync_s": 0},
        measured={
            "decode_step_s": 0.1,
            "decode_s_per_context_token": 0.0,
            "prefill_s_per_token": 0.0,
            "train_s_per_token": 10 / (8 * 110),
            "cores": 1,
            "busy_processes": 1,
        },
        controller={"offload": {"initial_t_local_s": 0, "floor_s": 0}, "poll_s": 0.1},
        training=training,
        run={"duration_s": 400, "max_steps": 12, "claim_delay_s": 0.0},
    )


def test_with_free_spot_k1_makes_a_step_take_the_longer_of_rollout_and_training():
    def steady(k: int) -> float:
        steps = run(ideal(max_staleness=k), "rlboost").steps[4:]
        return sum(s.ended_at - s.started_at for s in steps) / len(steps)

    rollout, train = 10.0, 10.0
    assert steady(0) == pytest.approx(rollout + train, rel=0.05)
    assert steady(1) == pytest.approx(max(rollout, train), rel=0.05)
    assert steady(2) == pytest.approx(max(rollout, train), rel=0.05)


def test_rollout_is_never_more_than_k_versions_ahead_and_no_sample_is_dropped():
    for k in (1, 2):
        result = run(small(training={"max_staleness": k}), "rlboost")
        steps = result.steps
        assert result.max_staleness == k and result.samples_done == result.samples_total > 0
        for s in steps:
            assert s.step == steps.index(s)
            # admitted when version s - K was published: at the start of the trainer's step s - K
            assert s.admitted_at == (steps[s.step - k].started_at if s.step >= k else 0.0)
            assert s.oldest_version is not None and s.step - k <= s.oldest_version <= s.step
        assert any(s.oldest_version < s.step for s in steps)  # some tokens did come from older versions
        # every step trains every one of its samples, in order
        assert all(s.trained_tokens == steps[0].trained_tokens or s.trained_tokens > 0 for s in steps)
        assert [s.started_at for s in steps] == sorted(s.started_at for s in steps)
        for a, b in zip(steps, steps[1:]):
            assert b.started_at == a.ended_at


@pytest.fixture(scope="module")
def comparison():
    return compare(small())


def test_every_variant_stays_under_the_work_conservation_bound(comparison):
    bound = comparison.bound
    assert bound is not None and bound.tokens_per_s > 0 and bound.mean_spot_gpus > 0
    for name, m in comparison.metrics.items():
        assert m.fraction_of_bound == pytest.approx(m.tokens_per_s / bound.tokens_per_s), name
        assert 0 < m.fraction_of_bound < 1, name
    free = compare(ideal())
    for name, m in free.metrics.items():
        assert m.fraction_of_bound < 1, name
    # free spot capacity: nothing but training binds, and K = 1 comes close to it
    assert free.bound.limit == "training"
    assert free.metrics["rlboost_async_k1"].fraction_of_bound > 0.9


def test_the_bound_adds_spot_gpus_as_the_trace_offers_them():
    scenario = small(availability={"source": "constant"})
    schedule = spot_schedule(scenario)
    with_spot = work_bound(scenario, range(5), schedule, (0.0, 100.0))
    assert with_spot.mean_spot_gpus == 3  # the pool, never preempted
    none = work_bound(small(spot={"max_instances": 0}), range(5), schedule, (0.0, 100.0))
    assert none.mean_spot_gpus == 0
    assert none.step_s == pytest.approx((none.rollout_gpu_s_reserved + none.train_gpu_s) / none.reserved_gpus)
    assert with_spot.tokens_per_s > none.tokens_per_s
    # capacity that never changes leaves nothing to bank; a trace's changes can only lower it
    assert with_spot.tokens_per_s_unbanked == pytest.approx(with_spot.tokens_per_s)
    trace = small()
    varying = work_bound(trace, range(5), spot_schedule(trace), (0.0, 900.0))
    assert 0 < varying.tokens_per_s_unbanked <= varying.tokens_per_s


def test_asynchrony_helps_with_and_without_spot(comparison):
    m = comparison.metrics
    assert m["rlboost_async_k1"].tokens_per_s > m["rlboost"].tokens_per_s
    assert m["ondemand_async_k1"].tokens_per_s > m["ondemand"].tokens_per_s
    for name in ("rlboost_async_k1", "rlboost_async_k2", "ondemand_async_k1", "ondemand_async_k2"):
        assert m[name].max_staleness == int(name[-1])
        result = comparison.results[name]
        assert result.generated_tokens == pytest.approx(
            result.trained_response_tokens + result.wasted_tokens + result.open_tokens
        )
    for name in ("ondemand", "paper", "ondemand_equal_cost"):
        assert m[name].max_staleness == 0, name


def test_this_projects_trainer_skips_the_old_logprob_forward_and_a_measured_profile_already_does():
    paper = load_scenario(REPO_ROOT / "deployments" / "sim" / "paper.yaml")
    recomputed = cluster_train_seconds(paper, 1e6, 8, recompute_logprobs=True)
    assert cluster_train_seconds(paper, 1e6, 8, recompute_logprobs=False) == pytest.approx(recomputed * 10 / 12)
    measured = small(measured=MEASURED)  # timed on the runtime's own trainer: nothing to take off
    assert cluster_train_seconds(measured, 1e3, 2, True) == cluster_train_seconds(measured, 1e3, 2, False)
    assert SPECS["paper"].recompute_logprobs and SPECS["ondemand"].recompute_logprobs
    assert not SPECS["rlboost"].recompute_logprobs and not SPECS["rlboost_async_k1"].recompute_logprobs


def errors(text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_scenario(text, "s.yaml")
    return str(caught.value)


def test_a_bad_max_staleness_names_file_line_field_and_fix():
    message = errors("availability:\n  source: constant\ntraining:\n  max_staleness: -1\n")
    assert "s.yaml:4: training.max_staleness: Input should be greater than or equal to 0 (got -1)" in message
    assert "Fix: give a value that satisfies this; the field: K of bounded staleness" in message
    assert "s.yaml:4: training.max_staleness" in errors(
        "availability:\n  source: constant\ntraining:\n  max_staleness: 1.5\n"
    )
    message = errors("availability:\n  source: constant\ntraining:\n  max_staleness: 3\nrun:\n  max_steps: 2\n")
    assert "s.yaml:4: training.max_staleness: 3 lets rollout run 3 steps ahead" in message
    assert "Fix: lower training.max_staleness below run.max_steps" in message
    message = errors(
        "availability:\n  source: constant\ntraining:\n  flops_per_param: 2\n  old_logprob_flops_per_param: 2\n"
    )
    assert "s.yaml:5: training.old_logprob_flops_per_param: 2 is not a share of training.flops_per_param" in message
    assert (
        parse_scenario("availability:\n  source: constant\ntraining:\n  max_staleness: 2\n").training.max_staleness == 2
    )


def test_train_first_keeps_the_reserved_gpus_training_while_spot_instances_finish_the_step(comparison):
    """`rlboost_async_k2_train_first`: with spot instances alive the reserved GPUs train the
    step's complete groups before they generate, so they generate less; it trains every sample
    in order; and without spot instances it is `rlboost_async_k2` to the last digit."""
    first, plain = comparison.results["rlboost_async_k2_train_first"], comparison.results["rlboost_async_k2"]
    assert first.samples_done == first.samples_total > 0 and first.max_staleness == 2
    assert 0 < first.reserved_busy_s < plain.reserved_busy_s
    assert [s.step for s in first.steps] == list(range(len(first.steps)))
    alone = small(spot={"max_instances": 0})
    a, b = run(alone, "rlboost_async_k2"), run(alone, "rlboost_async_k2_train_first")
    assert [(s.ended_at, s.trained_tokens) for s in a.steps] == [(s.ended_at, s.trained_tokens) for s in b.steps]


def test_the_bound_at_the_kv_caches_batch_is_never_above_the_bound():
    """Decode steps are at least max(tokens / slots, summed context / KV capacity): with long
    contexts the KV cache allows a smaller batch than `slots`, and the bound falls."""
    for scenario in (small(), small(workload={"response_cv": 3.0, "max_response_tokens": 8192})):
        bound = work_bound(scenario, range(5), spot_schedule(scenario), (0.0, 900.0))
        assert 0 < bound.tokens_per_s_kv <= bound.tokens_per_s
    heavy = small(
        workload={"mean_response_tokens": 3000, "response_cv": 2.0, "max_response_tokens": 16384},
        reserved={"max_running": 256},
        spot={"max_running": 256},
    )
    bound = work_bound(heavy, range(5), spot_schedule(heavy), (0.0, 900.0))
    assert bound.tokens_per_s_kv < bound.tokens_per_s
