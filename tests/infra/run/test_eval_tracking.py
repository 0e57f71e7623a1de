"""Evaluation results reach the run's experiment trackers and its step table: a real rl-train run
(one tiny step, TensorBoard) logs each evaluation's pass@k and avg@k under `eval/` at its step (the
base policy's too) and pass@k in the evaluated step's record; the rl-eval flow's evaluation of the
checkpoint lands in the same TensorBoard run, read back with TensorBoard's own reader."""

from __future__ import annotations

import json

import pytest

from infra.run.eval_result import EvalResult
from infra.run.reporting import step_table_rows
from infra.run.step_record import StepRecord
from infra.tracking.run_info import flat_metrics
from tests.helpers import save_tiny_model, tiny_run


def test_the_step_table_and_the_trackers_show_pass_at_k_where_an_evaluation_ran():
    evaluated = StepRecord(step=4, reward=0.5, tokens=40, eval_accuracy=0.25, eval_pass_at_k={1: 0.25, 4: 0.6})
    plain = StepRecord(step=5, reward=0.5, tokens=40)
    rows = step_table_rows([evaluated, plain])
    assert [row["held-out pass@k"] for row in rows] == ["1:0.250 4:0.600", ""]
    again = StepRecord.from_json(json.loads(json.dumps(evaluated.to_json())))
    assert again.eval_pass_at_k == {1: 0.25, 4: 0.6}
    assert flat_metrics(evaluated.to_json())["eval_pass_at_k/4"] == 0.6
    result = EvalResult(
        run="r", step=4, where="fabric", pass_at_k={1: 0.25, 4: 0.6}, avg_at_k=0.25, problems=2, samples=8,
        temperature=1.0, seconds=1.0, cost_usd=0.002,
    )  # fmt: skip
    assert result.metrics() == {
        "pass_at_1": 0.25,
        "pass_at_4": 0.6,
        "avg_at_k": 0.25,
        "samples": 8.0,
        "cost_usd": 0.002,
    }
    assert "cost_usd" not in result.model_copy(update={"where": "in_process"}).metrics()  # no eval $ in process


@pytest.mark.integration
def test_training_and_checkpoint_evaluations_reach_tensorboard(prefect_harness, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flows.rl_eval import rl_eval
    from flows.rl_train import rl_train

    overrides = tiny_run(
        save_tiny_model(tmp_path / "base"),
        tmp_path,
        "tracked-eval",
        1,
        {
            "fabric.enabled": False,
            "tracking": [{"kind": "tensorboard"}],
            "eval.size": 2,
            "eval.samples": 4,
            "eval.k": [1, 4],
        },
    )
    rl_train(overrides=overrides)
    run_dir = tmp_path / "runs" / "tracked-eval"
    record = json.loads((run_dir / "steps" / "000001" / "metrics.json").read_text())
    assert set(record["eval_pass_at_k"]) == {"1", "4"}
    checkpoint = rl_eval("tracked-eval", checkpoint=1, overrides=overrides, in_process=True)

    logdir = json.loads((run_dir / "tracking.json").read_text())["tensorboard"]["logdir"]
    events = EventAccumulator(logdir, size_guidance={"scalars": 0})
    events.Reload()

    def scalars(tag: str) -> list[tuple[int, object]]:
        return [(e.step, pytest.approx(e.value)) for e in events.Scalars(tag)]

    base, step = (json.loads((run_dir / "evals" / f"step_{s:06d}.in_process.json").read_text()) for s in (0, 1))
    # the base policy (step 0), the training's evaluation after step 1, the rl-eval flow's of checkpoint 1
    assert scalars("eval/pass_at_4") == [
        (0, base["pass_at_k"]["4"]),
        (1, step["pass_at_k"]["4"]),
        (1, checkpoint["pass_at_k"]["4"]),
    ]
    assert scalars("eval/avg_at_k") == [(0, base["avg_at_k"]), (1, step["avg_at_k"]), (1, checkpoint["avg_at_k"])]
    assert scalars("eval/pass_at_1")[1] == (1, record["eval_pass_at_k"]["1"])  # the step record's field
    assert not [tag for tag in events.Tags()["scalars"] if tag.startswith("eval_pass_at_k")], "pass@k logged twice"
