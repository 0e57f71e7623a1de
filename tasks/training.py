"""Prefect tasks of one RL step: thin wrappers around the in-process `TrainingSession`.

Each task takes the session key, a step number and file paths, and returns small dicts of
numbers and paths. No tensors ever pass through Prefect.
"""

from __future__ import annotations

import contextvars
import threading
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from infra.run.reporting import artifact_key
from infra.run.session import get_session
from tasks.checkpoint_event import emit_checkpoint_saved

TASK_OPTIONS = {"cache_policy": NO_CACHE, "persist_result": False}


@task(name="rollout", **TASK_OPTIONS)
def rollout_task(session_key: str, step: int, last_step: int | None = None) -> dict:
    """Generate `group_size` responses for each of the step's prompts; write them to rollout.jsonl.
    A progress artifact follows the complete groups of a rollout that runs over a second. With bounded
    staleness the next steps (up to `last_step`) are admitted too and generate while this one trains."""
    session = get_session(session_key)
    artifact = None
    task_run = contextvars.copy_context()  # progress comes on the fabric's delivery thread

    def on_progress(done: int, total: int) -> None:
        nonlocal artifact
        if artifact is not None:
            update_progress_artifact(artifact, 100.0 * done / total)
            return
        artifact = task_run.run(  # the task run's artifact, once the rollout has run a second
            create_progress_artifact,
            progress=100.0 * done / total,
            key=artifact_key(f"{session.config.run.name}-rollout"),
            description=f"step {step}: complete groups (each is trained as soon as it completes)",
        )

    return session.rollout(step, on_progress, last_step)


_AHEAD_DONE: dict[tuple[str, int], threading.Event] = {}
"""Per (session, step): set when the step's flow run no longer needs its `rollout-ahead` task."""


@task(name="rollout-ahead", **TASK_OPTIONS)
def rollout_ahead_task(session_key: str, step: int, last_step: int | None = None, poll_s: float = 0.2) -> dict:
    """Bounded staleness: follows the rollout of the steps admitted after `step` while `step`
    scores, trains and publishes (its bar runs beside theirs in the UI's timeline); returns when
    `end_rollout_ahead` is called, with the later steps' groups completed by then."""
    session = get_session(session_key)
    done = _AHEAD_DONE.setdefault((session_key, step), threading.Event())
    artifact = create_progress_artifact(
        progress=0.0,
        key=artifact_key(f"{session.config.run.name}-ahead"),
        description=f"steps after {step}: complete groups generated while step {step} trains",
    )
    total = session.config.rollout.prompts_per_step * session.config.training.max_staleness
    try:
        while True:
            finished = done.wait(poll_s)
            ahead = session.generated_ahead(step, last_step)
            update_progress_artifact(artifact, 100.0 * ahead["groups_done"] / max(total, 1))
            if finished:
                return ahead
    finally:
        _AHEAD_DONE.pop((session_key, step), None)


def end_rollout_ahead(session_key: str, step: int) -> None:
    """Let step `step`'s `rollout-ahead` task return (whether or not it has started yet)."""
    _AHEAD_DONE.setdefault((session_key, step), threading.Event()).set()


@task(name="score", **TASK_OPTIONS)
def score_task(session_key: str, step: int, rollout_path: str) -> dict:
    """Reward every response and compute group-normalised advantages; write scores.json."""
    return get_session(session_key).score(step, rollout_path)


@task(name="train", **TASK_OPTIONS)
def train_task(session_key: str, step: int, rollout_path: str, scores_path: str) -> dict:
    """One GRPO optimizer step on the scored rollout; the policy becomes version `step`."""
    return get_session(session_key).train(step, rollout_path, scores_path)


@task(name="publish", **TASK_OPTIONS)
def publish_task(session_key: str, step: int) -> dict:
    """Publish policy version `step` to the rollout instances (served at once, stored in the background)."""
    return get_session(session_key).publish(step)


@task(name="evaluate", **TASK_OPTIONS)
def evaluate_task(session_key: str) -> float:
    """Sampled exact-match accuracy of the current policy on the held-out problems."""
    return get_session(session_key).evaluate()


@task(name="checkpoint", **TASK_OPTIONS)
def checkpoint_task(session_key: str) -> str:
    """Write an atomic checkpoint (policy, optimizer, RNG, data cursor, history); returns its path.
    With `eval.on_checkpoint` it emits `rlboost.checkpoint.saved` (`tasks.checkpoint_event`)."""
    session = get_session(session_key)
    path = session.checkpoint()
    if session.config.eval.on_checkpoint:
        emit_checkpoint_saved(session.config.run.name, session.run_id, session.step, Path(path))
    return path


@task(name="account", **TASK_OPTIONS)
def account_task(session_key: str, step: int, tokens_trained: int) -> dict:
    """Record the step in the cost ledger; returns its cost in USD and the weight pulls recorded with it."""
    return get_session(session_key).account(step, tokens_trained)
