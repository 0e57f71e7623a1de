"""The CPU check's scenario (`bench/cpu_profile.scenario_data`): the demo configuration with a
measured profile is a valid scenario that carries the runtime's micro-batch and the measured
orchestration, and the simulator runs it; a profile brought to the fabric's speeds by a
calibration run (`fabric_profile`) takes its figures from that run and stretches only by what the
spot pool adds."""

from __future__ import annotations

import json
import statistics

import pytest

from bench.cpu_profile import fabric_profile, reserved_only, scenario_data, spot_schedule
from infra.run.config import DEFAULT_CONFIG, load_config
from infra.sim.runner import SPECS
from infra.sim.scenario import Scenario, prices_per_hour
from infra.sim.simulator import Simulation

PROFILE = {
    "decode_step_s": 0.0016,
    "decode_s_per_context_token": 3.1e-6,
    "prefill_s_per_token": 2.3e-5,
    "train_s_per_token": 5.8e-5,
    "prompt_tokens": 9.0,
    "mean_response_tokens": 5.0,
    "response_cv": 0.01,
    "boot_s": 4.0,
    "step_overhead_s": 0.057,
    "trainer_threads": 2,
    "slots": 64,
    "params": 865920,
    "bytes_per_param": 4,
}


def test_the_demo_as_a_scenario_keeps_its_micro_batch_and_orchestration():
    config = load_config(DEFAULT_CONFIG)
    scenario = Scenario.model_validate(scenario_data(config, PROFILE, 4, 2))
    assert scenario.training.micro_batch_samples == config.optim.micro_batch_size
    assert scenario.training.step_overhead_s == PROFILE["step_overhead_s"]
    result = Simulation(scenario, SPECS["rlboost"], spot_schedule(config), prices_per_hour(scenario)[:2]).run()
    assert len(result.steps) == 4
    for step in result.steps:
        # the whole step is one micro-batch: training follows the rollout, then the orchestration
        assert step.ended_at - step.started_at >= step.rollout_s + step.train_s + PROFILE["step_overhead_s"] - 1e-6


def test_a_fabric_profile_takes_the_calibration_runs_speeds_and_the_spot_pools_share_of_the_cores():
    config = load_config(DEFAULT_CONFIG)
    prompts = 9 * config.rollout.prompts_per_step * config.rollout.group_size
    rows = [  # the first (start-up) and last (evaluation) rows are left out
        {"step_s": 9.0, "rollout_s": 9.0, "train_overlap_s": 9.0, "tokens": 1},
        *(
            {"step_s": 1.4 + d, "rollout_s": 1.2 + d, "train_overlap_s": 0.7 + d, "tokens": 1280}
            for d in (0.0, 0.02, 0.04)
        ),
        {"step_s": 9.0, "rollout_s": 9.0, "train_overlap_s": 9.0, "tokens": 1},
    ]
    profile = fabric_profile(config, PROFILE, rows, 2)
    assert profile["in_fabric"] and profile["train_s_per_token"] == pytest.approx(0.72 / (1280 + prompts))
    assert profile["step_overhead_s"] == pytest.approx(0.2)
    # the engine's times scale by the run's generation (0.5 s) over the simulated one
    scale = profile["engine_scale"]
    assert profile["decode_step_s"] == pytest.approx(PROFILE["decode_step_s"] * scale)
    predicted = Scenario.model_validate(scenario_data(config, PROFILE, 5, 2, with_spot=False))
    result = Simulation(predicted, SPECS["ondemand"], spot_schedule(config), prices_per_hour(predicted)[:2]).run()
    assert scale == pytest.approx(0.5 / statistics.median(s.rollout_s for s in result.steps[1:-1]), rel=0.05)
    # the calibration run had no spot pool: without it nothing stretches; with it, the workers'
    # share of the 2 cores does
    alone = Scenario.model_validate(scenario_data(config, profile, 4, 2, with_spot=False))
    demo = Scenario.model_validate(scenario_data(config, profile, 4, 2))
    assert alone.spot.max_instances == 0 and alone.measured.slowdown == 1.0
    poisson = next(p for p in config.fabric.pools if p.capacity_class == "spot").availability.poisson
    up = poisson.mean_life_s / (poisson.mean_life_s + poisson.mean_gap_s)  # the share of time a worker is up
    assert demo.measured.slowdown == pytest.approx((1.5 + 2 * up) / 2)


def test_the_calibration_run_keeps_only_the_reserved_pool():
    config = load_config(DEFAULT_CONFIG)
    name, value = reserved_only(config).split("=", 1)
    pools = json.loads(value)
    assert name == "fabric.pools" and [p["capacity_class"] for p in pools] == ["reserved"]
    assert pools[0]["colocated"] is True
