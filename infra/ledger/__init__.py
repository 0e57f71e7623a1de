"""The cost ledger: what every run, step and instance cost, in SQLite or PostgreSQL (SQLAlchemy 2).

Modules: `models` (tables), `db` (engines, Alembic migrations, `LedgerUnavailable`), `migrations/`
(the schema's history), `config` (`LedgerConfig`, URL resolution), `recorder` (`Ledger`: the write
API), `reader` (loading a run back), `report` (pure cost computations -> `CostReport`), `comparison`
(a run against a measured reserved-only baseline run -> `BaselineComparison`).

Wiring into a training run (`run_id` is the fabric's run id, the one workers get as `--run-id`):

    ledger = Ledger(config.ledger.resolved_url())       # opens and migrates; default .rlboost/ledger.sqlite
    ledger.start_run(run_id, name=config.run.name)      # once per session (a repeat is harmless)
    for pool in pools: ledger.record_quote(run_id, pool, provider.quote(pool))   # when prices are read
    ledger.record_instance(run_id, record, provider=pool.provider)   # on launch, and on every change
                                                                     # (notice, termination) from provider.instances()
    ledger.record_step(run_id, k, started_at=t0)                     # when step k starts
    ledger.record_transfer(run_id, instance_id, version, source=..., nbytes=..., step=k)   # per weight pull
    ledger.record_usage(run_id, k, instance_id, seconds=..., tokens_generated=..., tokens_wasted=...)
    ledger.record_step(run_id, k, started_at=t0, ended_at=t1, tokens_trained=n)          # when step k ends
    ledger.finish_run(run_id)                                        # at the end
    ledger.report(run_id).summary()                                  # totals for the summary artifact
    ledger.compare(run_id, baseline_run_id)                          # vs a measured reserved-only run

The trainer's machine is an instance of role `trainer` (`record_instance(..., role="trainer")`).

`rlboost cost --run ID [--baseline ID]` prints and exports the same report (`infra/cli/cost.py`).
"""

from infra.ledger.comparison import BaselineComparison, BaselineMismatch
from infra.ledger.config import LedgerConfig, TrainerMachine, resolve_ledger_url
from infra.ledger.db import LedgerUnavailable
from infra.ledger.reader import UnknownRun
from infra.ledger.recorder import Ledger, LedgerWriteError
from infra.ledger.report import CostReport

__all__ = [
    "BaselineComparison",
    "BaselineMismatch",
    "CostReport",
    "Ledger",
    "LedgerConfig",
    "LedgerUnavailable",
    "LedgerWriteError",
    "TrainerMachine",
    "UnknownRun",
    "resolve_ledger_url",
]
