"""The calculator demo's configuration (`rlboost demo --env calculator`) through the rl-train flow:
its fabric with a spot instance preempted every few seconds, two steps of trajectories of at least
two turns each (a tool call, its result, the next turn: the tiny model that memorised two calculator
trajectories, on their problems), the step record's trajectory figures, and the demo's command line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from flows.rl_train import rl_train
from infra.cli.app import CALCULATOR_CONFIG, DEMOS, app
from infra.run.reporting import step_table_rows
from infra.run.step_record import StepRecord
from rl.rollout import read_samples
from tests.helpers import POISSON_CHURN, RESERVED_POOL, spot_pool, tiny_run
from tests.infra.rollout import agentic

pytestmark = pytest.mark.integration


def test_a_short_calculator_run_completes_with_trajectories_of_two_turns(prefect_harness, tmp_path):
    model = agentic.memorised_model(tmp_path / "model")
    lines = "".join(json.dumps({"prompt": p[0], "answer": p[1]}) + "\n" for p in (agentic.ONE_CALL, agentic.TWO_CALLS))
    (tmp_path / "problems.jsonl").write_text(lines)  # the two problems the model memorised, as a dataset
    data = {"data.source": "file", "data.path": str(tmp_path / "problems.jsonl")}
    pools = [{**RESERVED_POOL, "colocated": True}, spot_pool(1, **POISSON_CHURN)]
    settings = {**data, "data.eval_path": data["data.path"], "fabric.pools": pools, "rollout.max_new_tokens": 400}
    settings["rollout.temperature"] = 0.25  # the memorised trajectories, not the smallest model's slips
    overrides = tiny_run(model, tmp_path, "calculator", 2, {**settings, "eval.size": 2})
    state = rl_train(str(CALCULATOR_CONFIG), overrides, return_state=True)
    assert state.is_completed()
    steps = tmp_path / "runs" / "calculator" / "steps"
    for step in (1, 2):
        record = StepRecord.from_json(json.loads((steps / f"{step:06d}" / "metrics.json").read_text()))
        samples = read_samples(steps / f"{step:06d}" / "rollout.jsonl")
        assert len(samples) == 16 and all(len(s.turns) >= 1 and 0 in s.loss_mask for s in samples)
        assert record.turns_mean is not None and record.turns_mean >= 2 and record.reward > 0
        assert record.tool_calls == sum(len(s.turns) for s in samples) >= 16
        assert record.infra_failed == {} and record.migrated_mid_turn is not None
        assert record.env_s is not None and record.env_s >= 0
        assert record.tool_wait_fraction is not None and 0 < record.tool_wait_fraction < 1
        (row,) = step_table_rows([record])
        assert row["mean turns"] == f"{record.turns_mean:.2f}" and row["tool calls"] == str(record.tool_calls)


def test_the_demo_names_its_environments():
    result = CliRunner().invoke(app, ["demo", "--env", "chess"])
    assert result.exit_code == 2 and "--env chess: no such demo" in result.output and "calculator" in result.output


def test_every_demo_states_the_durations_measured_for_it():
    """`rlboost demo` prints what its pretraining and GRPO took on a 2-core machine: measured figures,
    never a placeholder (the calculator demo once printed "pretraining TBD; GRPO about 0-0 min")."""
    for name, target in DEMOS.items():
        fast, slow = target.grpo_s_per_step
        assert 0 < fast < slow, f"demo {name}: seconds per GRPO step {target.grpo_s_per_step}"
        assert target.pretrain_expected and "TBD" not in target.pretrain_expected, f"demo {name}"
