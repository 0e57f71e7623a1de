"""The `rl-train` flow: the GRPO step loop, one `rl-step` subflow per step.

    rl-train
      ensure-base-model            (pretrains the tiny model on first use)
      evaluate                     (held-out accuracy of the base policy)
      rl-step step-1 .. step-N     rollout -> score -> train [-> evaluate] [-> checkpoint]
      summary artifact, curves PNG
      (with `tracking:` every step's metrics, the configuration and the artifacts go to the
      experiment trackers too, and the run's page links to their runs: infra.tracking)

The flow holds no tensors: it opens an in-process `TrainingSession` and hands its key to the
tasks. Steps are idempotent by number: a re-run of a crashed run resumes from the latest
checkpoint and continues with the step after it.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.runtime import flow_run
from rich.console import Console

from flows.step_settings import step_heartbeats, step_settings
from infra.run.config import RunConfig, load_config
from infra.run.reporting import (
    artifact_key,
    plot_curves,
    progress_status,
    step_progress,
    step_table_rows,
    summary_markdown,
    summary_table,
    table_description,
)
from infra.run.session import close_session, get_session, open_session
from infra.run.step_record import StepRecord
from infra.run.summary import RunFacts, summarize
from infra.tracking.fanout import Trackers, open_trackers
from rl.checkpoint import latest_checkpoint
from tasks.pretraining import ensure_base_model
from tasks.training import (
    account_task,
    checkpoint_task,
    end_rollout_ahead,
    evaluate_task,
    publish_task,
    rollout_ahead_task,
    rollout_task,
    score_task,
    train_task,
)


@flow(name="rl-step", flow_run_name="step-{step}", persist_result=False)
def rl_step(
    session_key: str, step: int, evaluate: bool, checkpoint: bool, last_step: int | None = None, staleness: int = 0
) -> StepRecord:
    """One RL step: rollout (training complete groups as they arrive), score, train, publish the
    new policy version, account its cost (+ evaluate, checkpoint when due). With bounded
    staleness (`staleness` K >= 1) the rollout admits the next K steps (up to `last_step`), and a
    `rollout-ahead` task follows their generation while this step scores, trains and publishes."""
    with step_heartbeats():  # on a real Prefect server; they end with the work, not up to 1 s later
        return _step(session_key, step, evaluate, checkpoint, last_step, staleness)


def _step(
    session_key: str, step: int, evaluate: bool, checkpoint: bool, last_step: int | None, staleness: int
) -> StepRecord:
    """`rl_step`'s work, inside its flow run."""
    started = time.perf_counter()
    rollout = rollout_task(session_key, step, last_step)
    ahead = rollout_ahead_task.submit(session_key, step, last_step) if staleness and step != last_step else None
    try:
        scores = score_task(session_key, step, rollout["path"])
        metrics = train_task(session_key, step, rollout["path"], scores["path"])
        published = publish_task(session_key, step)
    finally:
        if ahead is not None:
            end_rollout_ahead(session_key, step)
    generated_ahead = ahead.result()["groups_done"] if ahead is not None else 0
    cost = account_task(session_key, step, int(metrics["response_tokens"]))
    eval_accuracy = evaluate_task(session_key) if evaluate else None
    session = get_session(session_key)
    evaluated = session.last_eval if evaluate else None
    record = StepRecord(
        step=step,
        reward=scores["reward"],
        accuracy=scores["accuracy"],
        eval_accuracy=eval_accuracy,
        eval_pass_at_k=evaluated.pass_at_k if evaluated else None,
        tokens=rollout["tokens"],
        tokens_per_s=rollout["tokens"] / max(rollout["seconds"], 1e-9),
        rollout_s=rollout["seconds"],
        train_s=metrics["seconds"],
        train_overlap_s=metrics.get("train_overlap_s", 0.0),  # none unless the groups were streamed
        entropy=metrics["entropy"],
        grad_norm=metrics["grad_norm"],
        trainer_peak_rss_mb=metrics["peak_rss_mb"],
        kl=metrics["kl"],
        cost_usd=cost["cost_usd"],
        policy_version=published["version"],
        weights_mb=cost["weights_mb"],
        pulls=cost["pulls"],
        pull_s=cost["pull_s"],
        weight_fallbacks=cost["weight_fallbacks"],
        version_lag_mean=metrics["version_lag_mean"],
        version_lag_max=metrics["version_lag_max"],
        version_lag_histogram=metrics["version_lag_histogram"],
        objective=metrics["objective"],
        is_weight_mean=metrics.get("is_weight_mean", 1.0),  # the objectives without importance weights: none
        is_weight_deviation=metrics.get("is_weight_deviation", 0.0),
        is_truncated_fraction=metrics.get("is_truncated_fraction", 0.0),
        logprob_gap=metrics.get("rollout_logprob_gap"),
        groups_generated_ahead=generated_ahead,
        **_fabric_counts(rollout),
        step_s=time.perf_counter() - started,
    )
    session.record(record)
    if checkpoint:
        checkpoint_task(session_key)
    create_table_artifact(
        table=step_table_rows([record], adapters=session.adapter is not None),
        description=table_description(
            f"RL step {step}: reward, accuracy, tokens, throughput, timings, the version published", session.adapter
        ),
    )
    return record


def _fabric_counts(rollout: dict) -> dict[str, Any]:
    """The fabric's counts of a rollout (preemptions, migrations, ...: none in process), which the
    rollout task names as the record's fields."""
    return {key: value for key, value in rollout.items() if key not in ("path", "tokens", "seconds")}


@flow(name="rl-train", log_prints=False, persist_result=False)
def rl_train(
    config_path: str | None = None, overrides: dict[str, Any] | None = None, extra_steps: int | None = None
) -> dict:
    """Train a policy with GRPO for `run.steps` steps (resuming from the run's latest checkpoint);
    with `extra_steps`, train that many steps beyond the latest checkpoint instead (nightly runs)."""
    if extra_steps is not None and extra_steps < 1:
        raise ValueError(f"extra_steps must be at least 1, got {extra_steps}")
    config: RunConfig = load_config(config_path, overrides)
    logger = get_run_logger()
    ensure_base_model(config)
    key = f"{config.run.name}-{uuid.uuid4().hex[:8]}"
    session = open_session(key, config)
    trackers = Trackers()
    try:
        if extra_steps is not None:
            steps = session.step + extra_steps
            config = config.model_copy(update={"run": config.run.model_copy(update={"steps": steps})})
        trackers = open_trackers(config.tracking, config.run.name, config.run.directory, str(flow_run.id))
        trackers.log_params(config.model_dump(mode="json"))
        with step_settings():  # set once: entering Prefect's settings context takes ~0.07 s
            return _train_loop(config, key, session, logger, trackers)
    finally:
        trackers.close()
        close_session(key)


def _train_loop(config: RunConfig, key: str, session, logger, trackers: Trackers) -> dict:
    total, start = config.run.steps, session.step
    if session.resumed_from is not None:
        logger.info("resuming %s from its checkpoint at step %d", config.run.name, start)
    if not session.history.evals:
        base = evaluate_task(key)
        logger.info("base policy held-out accuracy (T=%.1f): %.3f", config.eval.temperature, base)
        trackers.log_metrics(start, {"eval_accuracy": base}, prefix="")
        trackers.log_metrics(start, session.last_eval.metrics())  # eval/pass_at_<k>, eval/avg_at_k
    progress_id = create_progress_artifact(
        progress=100.0 * start / total,
        key=artifact_key(f"{config.run.name}-progress"),
        description="RL steps completed",
    )
    console = Console()
    began = time.perf_counter()
    with step_progress(console) as progress:
        bar = progress.add_task("steps", total=total, completed=start, status="")
        for step in range(start + 1, total + 1):
            row = rl_step(
                key,
                step,
                evaluate=step % config.eval.every == 0 or step == total,
                checkpoint=step % config.run.checkpoint_every == 0 or step == total,
                last_step=total,
                staleness=config.training.max_staleness,
            )
            trackers.log_step(step, row.to_json())
            if row.eval_accuracy is not None:  # evaluated after this step: pass@k, avg@k under eval/
                trackers.log_metrics(step, session.last_eval.metrics())
            status = progress_status(session.history)
            progress.update(bar, advance=1, status=status)
            if row.eval_accuracy is not None and not console.is_terminal:
                console.print(f"GRPO step {step}/{total}  {status}")
            update_progress_artifact(progress_id, 100.0 * step / total)
    return _report(config, session, trackers, minutes=(time.perf_counter() - began) / 60)


def _report(config: RunConfig, session, trackers: Trackers, minutes: float) -> dict:
    """The end of the run: its curves, its summary (printed, returned, a markdown artifact, to the
    trackers with the curves and the final checkpoint) and the table of every step."""
    history, adapter, baseline = session.history, session.adapter, config.ledger.baseline_run_id
    costs = session.cost_report()  # one report for the plot and the summary: their totals agree
    plot = plot_curves(history.steps, history.evals, config.run.directory / "curves.png", costs)
    facts = RunFacts(
        name=config.run.name,
        steps=config.run.steps,
        max_staleness=config.training.max_staleness,
        minutes=minutes,
        curves_png=plot,
        checkpoint=session.checkpoint_dir,
        ledger_run_id=session.run_id,
        adapter_mib=adapter.nbytes / 2**20 if adapter else None,
        baseline=session.accounting.baseline_summary(baseline) if baseline else {},
    )
    summary = summarize(history, costs.summary(), facts)
    trackers.log_artifacts(plot, latest_checkpoint(session.checkpoint_dir))
    summary |= trackers.finish(config.run.steps, summary)  # what each tracker dropped, if any
    Console().print(summary_table(summary))
    create_table_artifact(
        key=artifact_key(f"{config.run.name}-steps"),
        table=step_table_rows(history.steps, adapters=adapter is not None),
        description=table_description("Every RL step of the run", adapter),
    )
    create_markdown_artifact(
        key=artifact_key(f"{config.run.name}-summary"),
        markdown=summary_markdown(summary, plot),
        description="Accuracy gain, reward, tokens and cost of the run, with its curves",
    )
    return summary


def run_training(config_path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> dict:
    return rl_train(str(config_path) if config_path else None, overrides)
