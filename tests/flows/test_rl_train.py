"""The rl-train flow end to end under a real (ephemeral) Prefect server: two steps, artifacts,
subflow/task structure, and resumption from the checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import re

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
)

from flows.rl_train import rl_train
from infra.ledger.recorder import Ledger
from tests.helpers import save_tiny_model, tiny_run, tiny_shape

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    shape = tiny_shape()
    return save_tiny_model(tmp_path_factory.mktemp("model") / "base", shape)


def _overrides(base_model, tmp_path, steps):
    return tiny_run(
        base_model, tmp_path, "flow-test", steps, {"run.checkpoint_every": 1, "eval.size": 16, "eval.every": 1}
    )


async def _children(flow_run_id):
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
        tasks = {}
        for run in runs:
            task_runs = await client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[run.id]))
            )
            tasks[run.name] = sorted(t.name.rsplit("-", 1)[0] for t in task_runs if t.state.is_completed())
        return runs, tasks


TRAINER = {"machine_type": "a2-highgpu-1g", "price_per_hour": 3.67}


def test_two_steps_then_resume(prefect_harness, base_model, tmp_path):
    state = rl_train(overrides=_overrides(base_model, tmp_path, 2), return_state=True)
    assert state.is_completed()
    summary = state.result()
    assert summary["steps"] == 2
    run_dir = tmp_path / "runs" / "flow-test"
    assert (run_dir / "checkpoints" / "step_000002" / "model.safetensors").exists()
    assert (run_dir / "curves.png").stat().st_size > 10_000
    pulls = {}
    for step in (1, 2):
        metrics = json.loads((run_dir / "steps" / f"{step:06d}" / "metrics.json").read_text())
        assert metrics["step"] == step and metrics["tokens"] > 0
        assert 0.0 <= metrics["reward"] <= 1.0
        assert metrics["policy_version"] == step  # the version published at the step's end
        assert (metrics["pull_s"] is None) == (metrics["pulls"] == 0) and (metrics["pull_s"] or 1) > 0
        pulls[step] = (metrics["pulls"], metrics["pull_s"])

    runs, tasks = asyncio.run(_children(state.state_details.flow_run_id))
    steps = sorted(r.name for r in runs if r.name.startswith("step-"))
    assert steps == ["step-1", "step-2"]
    assert all(r.state.is_completed() for r in runs)
    assert tasks["step-1"] == ["account", "checkpoint", "evaluate", "publish", "rollout", "score", "train"]
    with Ledger() as ledger:  # the tests' ledger (RLBOOST_LEDGER_URL, tests/conftest.py)
        costs = ledger.report(summary["ledger_run_id"])
    assert [s.step for s in costs.steps] == [1, 2]
    assert all(s.ended_at is not None and s.tokens_trained > 0 for s in costs.steps)
    assert {s.step: (s.pulls, s.pull_s_max) for s in costs.steps} == pulls  # the ledger has the pull times
    # The demo's colocated reserved instance runs on the trainer's machine: it is the trainer, up
    # for every step, so each step carries the step's duration of it.
    (trainer,) = [i for i in costs.instances if i.role == "trainer"]
    assert (trainer.instance_id, trainer.usd_per_hour) == ("reserved-colocated", 3.67)
    for s in costs.steps:  # to the microsecond the database keeps of each timestamp (1e-8 USD: ~10 us)
        assert s.trainer_usd == pytest.approx((s.ended_at - s.started_at).total_seconds() * 3.67 / 3600, abs=1e-8)
    assert 0 < summary["trainer_usd"] <= costs.trainer_usd  # billed to the summary; the session ran on after it
    # The summary's books add up: the steps and each line of what no step holds (the base
    # evaluation before step 1, evaluations and checkpoints between steps) make its total.
    lines = [value for key, value in summary.items() if key.startswith("unattributed_")]
    assert summary["unattributed_before_step_1_usd"] > 0 and summary["unattributed_between_steps_usd"] > 0
    assert abs(summary["attributed_usd"] + sum(lines) - summary["total_usd"]) < 1e-6  # lines < 1e-6 left out
    assert summary["attributed_usd"] == pytest.approx(sum(s.cost_usd for s in costs.steps))

    async def artifacts(**filters):
        async with get_client() as client:  # filtered: the session's other runs made many more
            return await client.read_artifacts(**filters)

    # (no "flow-test-rollout": a rollout shorter than a second makes no progress artifact)
    wanted = ["flow-test-summary", "flow-test-steps", "flow-test-progress"]
    found = asyncio.run(artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=wanted))))
    assert set(wanted) <= {a.key for a in found}
    step_runs = FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in runs]))
    per_step_tables = [
        a for a in asyncio.run(artifacts(flow_run_filter=step_runs)) if a.type == "table" and a.key is None
    ]
    assert len(per_step_tables) == 2

    # Resume: the same run asked for 3 steps continues from its step-2 checkpoint, in process on a
    # trainer priced by `ledger.trainer`; it is the same ledger run, so it cannot be its own baseline.
    first = summary["ledger_run_id"]
    overrides = {
        **_overrides(base_model, tmp_path, 3),
        "fabric.enabled": False,
        "ledger.trainer": TRAINER,
        "ledger.baseline_run_id": first,
    }
    state = rl_train(overrides=overrides, return_state=True)
    assert state.is_completed()
    runs, _ = asyncio.run(_children(state.state_details.flow_run_id))
    assert sorted(r.name for r in runs if r.name.startswith("step-")) == ["step-3"]
    summary = state.result()
    assert summary["steps"] == 3
    assert summary["trainer_usd"] > 0
    assert summary["ledger_run_id"] == first
    assert summary["vs_baseline"] == f"not compared: run {first} cannot be its own baseline: name a reserved-only run"
    assert "cost_efficiency_vs_baseline" not in summary
    assert (run_dir / "checkpoints" / "step_000003").exists()


def test_a_lora_run_labels_its_versions_as_adapters_with_their_size(prefect_harness, base_model, tmp_path):
    """With `model.lora` the step tables' version column reads `adapter version`, their description
    says what one adapter version weighs, and the ledger's workload says the run trained adapters."""
    overrides = {
        **_overrides(base_model, tmp_path, 1),
        "run.name": "flow-lora",
        "fabric.enabled": False,
        "model.lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
    }
    state = rl_train(overrides=overrides, return_state=True)
    assert state.is_completed()
    summary = state.result()
    with Ledger() as ledger:
        lora = ledger.report(summary["ledger_run_id"]).workload["lora"]
    assert (lora["r"], lora["target_modules"]) == (4, ["q_proj", "v_proj"]) and lora["trainable_parameters"] > 0
    assert summary["adapter_mib_per_version"] == pytest.approx(lora["adapter_bytes"] / 2**20)

    async def steps_table():
        async with get_client() as client:
            (found,) = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["flow-lora-steps"]))
            )
            return found

    table = asyncio.run(steps_table())
    (row,) = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert row["adapter version"] == "1" and "version" not in row
    mib = lora["adapter_bytes"] / 2**20
    assert f"Versions are LoRA adapters ({mib:.2f} MiB, {lora['trainable_parameters']:,} parameters each)" in (
        table.description or ""
    )


def test_bad_config_fails_before_any_work(prefect_harness, tmp_path):
    from infra.run.config import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.group_size"):
        rl_train(overrides={"rollout.group_size": 1, "run.output_dir": str(tmp_path)})


def test_the_deepspeed_trainer_through_the_fabric(prefect_harness, base_model, tmp_path):
    """Two ranks (ZeRO-2) train what the fabric's instances generate; the weights they publish are
    gathered from the ranks; the checkpoint holds every rank's shard."""
    overrides = {
        **_overrides(base_model, tmp_path, 2),
        "run.name": "flow-deepspeed",
        "trainer.backend": "deepspeed",
        "trainer.world_size": 2,
        "trainer.threads_per_rank": 1,
    }
    state = rl_train(overrides=overrides, return_state=True)
    assert state.is_completed()
    summary = state.result()
    assert summary["steps"] == 2
    run_dir = tmp_path / "runs" / "flow-deepspeed"
    checkpoint = run_dir / "checkpoints" / "step_000002"
    assert len(list((checkpoint / "deepspeed" / "state").glob("zero_pp_rank_*_optim_states.pt"))) == 2
    for step in (1, 2):
        metrics = json.loads((run_dir / "steps" / f"{step:06d}" / "metrics.json").read_text())
        assert metrics["tokens"] > 0 and metrics["train_overlap_s"] >= 0
    log = (run_dir / "trainer" / "ranks.log").read_text()
    pids = [int(pid) for pid in re.findall(r"rlboost trainer rank \d \(pid (\d+)\) ready", log)]
    assert len(pids) == 2
    for pid in pids:  # the ranks ended with the run
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
