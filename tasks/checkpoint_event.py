"""The Prefect event of a saved checkpoint, `rlboost.checkpoint.saved`, for automations to hang on.

With `eval.on_checkpoint: true` the `checkpoint` task emits it for every checkpoint: resource
`rlboost.run.<run.name>`, payload the run's name and id, the step and the checkpoint's directory.
The automation `rlboost up` creates from `deployments/automations/eval-on-checkpoint.yaml` runs
the `rl-eval/checkpoint` deployment with that run and step.
"""

from __future__ import annotations

from pathlib import Path

from prefect.events import Event, emit_event

CHECKPOINT_SAVED = "rlboost.checkpoint.saved"


def run_resource(run_name: str) -> dict[str, str]:
    """The Prefect event resource of a run."""
    return {"prefect.resource.id": f"rlboost.run.{run_name}", "prefect.resource.name": run_name}


def emit_checkpoint_saved(run_name: str, run_id: str, step: int, checkpoint: Path) -> Event | None:
    """Emit `rlboost.checkpoint.saved` for `checkpoint` (the event, or None where events are off)."""
    return emit_event(
        CHECKPOINT_SAVED,
        resource=run_resource(run_name),
        payload={"run": run_name, "run_id": run_id, "step": step, "checkpoint": str(checkpoint)},
    )
