"""The rl-train flow with bounded staleness (K = 2) under a real Prefect server: the rollout of
later steps runs while each step trains (a `rollout-ahead` task beside `train` in every step's
timeline), every trained token comes from a version within K of the one it trains, the figures
reach the step files and the summary, and a second run resumes from the checkpoint within the bound."""

from __future__ import annotations

import asyncio
import json

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)

from flows.rl_train import rl_train
from rl.rollout import read_samples
from tests.helpers import save_tiny_model, tiny_run, tiny_shape

pytestmark = pytest.mark.integration

K = 2


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    shape = tiny_shape()
    return save_tiny_model(tmp_path_factory.mktemp("model") / "base", shape)


def _overrides(base_model, tmp_path, steps):
    return tiny_run(
        base_model,
        tmp_path,
        "stale-test",
        steps,
        {"run.checkpoint_every": 2, "rollout.max_new_tokens": 12, "eval.every": 100, "training.max_staleness": K},
    )


async def _step_tasks(flow_run_id):
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
        tasks = {}
        for run in runs:
            task_runs = await client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[run.id]))
            )
            tasks[run.name] = {t.name.rsplit("-", 1)[0]: t for t in task_runs}
        return tasks


def _lags(run_dir, step):
    samples = read_samples(run_dir / "steps" / f"{step:06d}" / "rollout.jsonl")
    return [step - 1 - v for s in samples for v in s.versions()]


def test_rollout_runs_ahead_within_the_bound_and_resumes(prefect_harness, base_model, tmp_path):
    state = rl_train(overrides=_overrides(base_model, tmp_path, 4), return_state=True)
    assert state.is_completed()
    summary = state.result()
    assert summary["max_staleness"] == K and 0 <= summary["version_lag_max"] <= K
    run_dir = tmp_path / "runs" / "stale-test"
    tasks = asyncio.run(_step_tasks(state.state_details.flow_run_id))
    assert sorted(tasks) == ["step-1", "step-2", "step-3", "step-4"]
    for step in (1, 2, 3):  # the last step admits nothing after it
        ahead, train = tasks[f"step-{step}"]["rollout-ahead"], tasks[f"step-{step}"]["train"]
        assert ahead.state.is_completed()
        assert ahead.start_time <= train.end_time <= ahead.end_time  # beside train in the timeline
    assert "rollout-ahead" not in tasks["step-4"]
    lags = {step: _lags(run_dir, step) for step in range(1, 5)}
    assert all(0 <= lag <= K for step_lags in lags.values() for lag in step_lags)
    assert any(lag > 0 for step_lags in lags.values() for lag in step_lags)  # some rollout ran ahead
    for step in range(1, 5):
        metrics = json.loads((run_dir / "steps" / f"{step:06d}" / "metrics.json").read_text())
        assert metrics["version_lag_max"] == max(lags[step])
        assert sum(metrics["version_lag_histogram"].values()) == len(lags[step]) == metrics["tokens"]
        assert 0 < metrics["is_weight_mean"] and 0 <= metrics["is_truncated_fraction"] <= 1
        assert metrics["objective"] == "decoupled" and metrics["is_weight_deviation"] >= 0  # `auto` at K = 2
    # A second run of the same run directory continues after the step-4 checkpoint, within the bound.
    state = rl_train(overrides=_overrides(base_model, tmp_path, 6), return_state=True)
    assert state.is_completed() and state.result()["steps"] == 6
    assert all(0 <= lag <= K for step in (5, 6) for lag in _lags(run_dir, step))
