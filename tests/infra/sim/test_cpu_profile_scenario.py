"""The CPU check's scenario (`bench/cpu_profile.scenario_data`): the demo configuration with a
measured profile is a valid scenario that carries the runtime's micro-batch and the measured
orchestration, and the simulator runs it."""

from __future__ import annotations

from bench.cpu_profile import scenario_data, spot_schedule
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
    "prefect_step_s": 0.05,
    "score_s": 0.003,
    "ledger_step_s": 0.004,
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
