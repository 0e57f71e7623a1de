"""Reading a run back from the ledger: `load_run(engine, run_id) -> RunRecords`, `list_runs(engine)`.

The rows come back as detached model instances (plain objects, no database access afterwards),
the input of the pure computations in `infra.ledger.report`. An unknown run id raises
`UnknownRun`, whose message lists the runs the ledger holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from infra.ledger.models import Instance, Run, Step, SweptInstance, Usage, WeightTransfer

RUNS_LISTED = 20
"""Most recent runs named in an `UnknownRun` message."""


class UnknownRun(LookupError):
    """No such run in the ledger; the message lists the runs it holds."""


@dataclass(frozen=True)
class RunRecords:
    """Everything the ledger holds about one run."""

    run: Run
    steps: list[Step]
    instances: list[Instance]
    usage: list[Usage]
    transfers: list[WeightTransfer]


def list_runs(engine: Engine) -> list[Run]:
    """Every run, most recently started first."""
    with Session(engine, expire_on_commit=False) as session:
        return list(session.scalars(select(Run).order_by(Run.started_at.desc(), Run.run_id)))


def list_swept(engine: Engine) -> list[SweptInstance]:
    """Every VM the sweep deleted, most recent first."""
    with Session(engine, expire_on_commit=False) as session:
        return list(session.scalars(select(SweptInstance).order_by(SweptInstance.swept_at.desc())))


def load_run(engine: Engine, run_id: str) -> RunRecords:
    """All rows of `run_id`, ordered by step and instance; `UnknownRun` if there is no such run."""
    with Session(engine, expire_on_commit=False) as session:
        run = session.get(Run, run_id)
        if run is None:
            raise UnknownRun(_unknown_run_message(engine, run_id))

        def rows(model, *order):
            return list(session.scalars(select(model).where(model.run_id == run_id).order_by(*order)))

        return RunRecords(
            run=run,
            steps=rows(Step, Step.step),
            instances=rows(Instance, Instance.launched_at, Instance.instance_id),
            usage=rows(Usage, Usage.step, Usage.instance_id),
            transfers=rows(WeightTransfer, WeightTransfer.instance_id, WeightTransfer.version, WeightTransfer.source),
        )


def _unknown_run_message(engine: Engine, run_id: str) -> str:
    runs = list_runs(engine)
    if not runs:
        return f"no run {run_id!r}: the ledger holds no runs yet"
    shown = [
        f"{run.run_id} ({run.name or 'unnamed'}, started {run.started_at:%Y-%m-%d %H:%M} UTC)"
        for run in runs[:RUNS_LISTED]
    ]
    more = f" and {len(runs) - RUNS_LISTED} older" if len(runs) > RUNS_LISTED else ""
    return f"no run {run_id!r} in the ledger; it holds {len(runs)}: " + ", ".join(shown) + more
