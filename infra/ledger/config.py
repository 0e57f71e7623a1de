"""What the cost ledger records and where: the `ledger` section of a run configuration (the URL,
the trainer's machine, a measured baseline run to compare with), and URL resolution.

One ledger holds many runs. The URL is, first that applies: the explicit one (`ledger.url`, or
`rlboost cost --db`), `$RLBOOST_LEDGER_URL`, then `sqlite:///.rlboost/ledger.sqlite` (relative to
the working directory, beside the default base model in `.rlboost/`).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field

from rl import env_vars
from rl.config import Section

LEDGER_URL_ENV = env_vars.LEDGER_URL
DEFAULT_LEDGER_URL = "sqlite:///.rlboost/ledger.sqlite"


def resolve_ledger_url(url: str | None = None) -> str:
    """`url` if given, else `$RLBOOST_LEDGER_URL`, else `DEFAULT_LEDGER_URL`."""
    return url or os.environ.get(LEDGER_URL_ENV) or DEFAULT_LEDGER_URL


class TrainerMachine(Section):
    """The machine the trainer runs on, recorded in the ledger as instance `trainer` (role `trainer`).

    It is billed from the session's start to its end and attributed to each step for the step's
    whole duration, like any instance.

    Leave it unset when the reserved pool is `colocated: true`: the co-located instance *is* the
    trainer's machine (its pool's `machine_type` and `price_per_hour`), recorded once with role
    `trainer`; setting both is refused, since it would count that machine twice."""

    machine_type: str = Field(min_length=1)
    """The machine type it is, e.g. `a2-highgpu-1g` (recorded; local runs stand for it)."""
    price_per_hour: float = Field(ge=0)
    """What one hour of it costs, USD."""
    capacity_class: Literal["reserved", "ondemand"] = "reserved"
    """How it is bought: `reserved` (a commitment) or `ondemand`."""
    provider: Literal["local", "gcp", "azure"] = "local"
    """Whose machine it is (recorded with the instance)."""


class LedgerConfig(Section):
    """Where the cost ledger is recorded, what the trainer runs on, and the baseline to compare with."""

    url: str | None = None
    """SQLAlchemy URL of the ledger database: `sqlite:///PATH` or `postgresql+psycopg://USER@HOST/DB`
    (`postgresql://` also means psycopg). Default: `$RLBOOST_LEDGER_URL`, else
    `sqlite:///.rlboost/ledger.sqlite`."""
    trainer: TrainerMachine | None = None
    """The trainer's machine (None: a colocated reserved pool is it, or it is not recorded, and
    the report says so)."""
    baseline_run_id: str | None = None
    """Ledger run id of a measured reserved-only run (yours, of this configuration with its spot
    pools removed: the ledger checks the recorded model, data, batch, trainer and other pools): the
    run summary compares this run's $ per million trained tokens and trained tokens/s with it."""

    def resolved_url(self) -> str:
        """The URL the run records to (see `resolve_ledger_url`)."""
        return resolve_ledger_url(self.url)


def trainer_machine(workload: dict[str, Any]) -> dict[str, Any] | None:
    """The trainer's machine (`ledger.trainer`) of a recorded workload, of any age: `trainer.machine`,
    or, recorded before the trainer's configuration was, the `trainer` section itself."""
    trainer = workload.get("trainer")
    if isinstance(trainer, dict) and "backend" in trainer:
        return trainer.get("machine")
    return trainer
