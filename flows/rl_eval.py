"""The `rl-eval` flow: pass@k and avg@k of one checkpoint of a run, on the run's rollout fabric.

    rl-eval                         (deployment rl-eval/checkpoint; run by the automation
      evaluate-checkpoint            rlboost-eval-on-checkpoint on each rlboost.checkpoint.saved)
      table artifact: pass@k, avg@k, preemptions, eval $; the run's trackers get them (eval/)

The run's configuration is the deployment's (`config_path`, `overrides`), its `run.name` the
`run_name` given; `checkpoint` None is the run's newest. With `fabric.enabled` the evaluation runs
on the run's pools, spot instances included (`infra.run.evaluation`), else in this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from infra.run.config import load_config
from infra.run.evaluation import evaluate_checkpoint, find_checkpoint, track
from infra.run.reporting import artifact_key


@task(name="evaluate-checkpoint", cache_policy=NO_CACHE, persist_result=False)
def evaluate_checkpoint_task(config, checkpoint_path: str, fabric: bool) -> dict:
    """Evaluate one checkpoint and log it to the run's trackers; returns its `EvalResult` as JSON."""
    result = evaluate_checkpoint(config, Path(checkpoint_path), fabric=fabric)
    track(config, result, str(flow_run.id))
    return result.to_json()


@flow(name="rl-eval", flow_run_name="{run_name}-eval", persist_result=False)
def rl_eval(
    run_name: str,
    checkpoint: int | None = None,
    config_path: str | None = None,
    overrides: dict[str, Any] | None = None,
    in_process: bool = False,
) -> dict:
    """pass@k of run `run_name`'s checkpoint of step `checkpoint` (None: the newest), on the
    run's fabric unless `in_process` (or `fabric.enabled` is false)."""
    config = load_config(config_path, {**(overrides or {}), "run.name": run_name})
    path = find_checkpoint(config.run.directory, checkpoint)
    result = evaluate_checkpoint_task(config, str(path), config.fabric.enabled and not in_process)
    create_table_artifact(
        key=artifact_key(f"{run_name}-eval-{result['step']}"),
        table=[
            {"k": k, "pass@k": value, "avg@k": result["avg_at_k"]}
            for k, value in sorted(result["pass_at_k"].items(), key=lambda item: int(item[0]))
        ],
        description=(
            f"pass@k of {run_name} at step {result['step']} ({result['where']}): {result['samples']} samples of "
            f"{result['problems']} problems, {result['preemptions']} preemptions, eval ${result['cost_usd']:.4f}"
        ),
    )
    return result
