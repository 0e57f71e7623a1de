"""The cost ledger: what every run, step and instance cost, in SQLite or PostgreSQL (SQLAlchemy 2).

Modules: `models` (tables), `db` (engines, Alembic migrations, `LedgerUnavailable`), `migrations/`
(the schema's history), `config` (`LedgerConfig`, URL resolution, `TrainerMachine`), `recorder`
(`Ledger`: the write API, idempotent upserts), `reader` (loading a run back), `report` (pure cost
computations -> `CostReport`), `books` (what no step holds, as named lines that add up to the
total), `comparison` (a run against a measured reserved-only baseline run of the same recorded
workload -> `BaselineComparison`).

`infra.run.accounting.RunAccounting` writes a training run into it; the trainer's machine is an
instance of role `trainer`; `rlboost cost --run ID [--baseline ID]` prints and exports the report
(`infra/cli/cost.py`). The API wired step by step, the report's definitions and each write's key:
docs/cost-ledger.md ("In code"); what is recorded and why: docs/internals.md §7. The package
imports none of its modules, so loading `config` (a run's `ledger` section) loads no SQLAlchemy.
"""
