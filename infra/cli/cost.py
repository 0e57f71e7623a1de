"""`rlboost cost --run ID [--baseline ID] [--predict]`: a run's cost report from the ledger, as rich
tables and exports.

Reads the ledger at `--db` (default `$RLBOOST_LEDGER_URL`, else `sqlite:///.rlboost/ledger.sqlite`)
and prints the run's `CostReport`: per-step costs (the essential `STEP_COLUMNS`, within 80 columns;
`--wide` or `--columns` for the rest), spend per capacity class, run totals. The books
add up: the steps and the named lines of what no step holds (before step 1, between steps, after
the last step, egress outside steps, ...) sum to the total, in the tables, `--csv` (a row per step,
per line, then `total`) and `--json` (the whole report). `--baseline`: the comparison with a
measured reserved-only run of the same workload (`infra.ledger.comparison`); `--predict`: the
simulator's prediction for the run's recorded workload beside the measured figures, with where each
scenario figure came from (`infra.sim.from_run`). An unknown run, a missing price, a baseline that
cannot be compared or a run that cannot be simulated exits 2, an unreachable database 1, each with
one message saying how to fix it.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from pydantic import TypeAdapter
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from rl import env_vars

if TYPE_CHECKING:  # the ledger (SQLAlchemy, Alembic) and the simulator load when `cost` runs, not with `rlboost`
    from infra.ledger.comparison import BaselineComparison
    from infra.ledger.report import CostReport
    from infra.sim.from_run import Prediction

RunIdOption = Annotated[
    str, typer.Option("--run", help="Run id in the ledger (the rollout fabric's run id, e.g. grpo-demo-1a2b3c4d).")
]
DbOption = Annotated[
    Optional[str],
    typer.Option(
        "--db", help=f"Ledger database URL (default: ${env_vars.LEDGER_URL}, else sqlite:///.rlboost/ledger.sqlite)."
    ),
]
CsvOption = Annotated[
    Optional[Path], typer.Option("--csv", help="Write the per-step costs and a total row to this CSV file.")
]
BaselineOption = Annotated[
    Optional[str],
    typer.Option(
        "--baseline",
        help="Ledger run id of a measured reserved-only run of the same config to compare with (no spot pools).",
    ),
]
JsonOption = Annotated[Optional[Path], typer.Option("--json", help="Write the whole report to this JSON file.")]
PredictOption = Annotated[
    bool,
    typer.Option(
        "--predict",
        help="Also run the simulator on the run's recorded workload and show its prediction beside the measured figures.",
    ),
]

WideOption = Annotated[
    bool, typer.Option("--wide", help="Every column of the per-step table (it may be wider than the terminal).")
]
ColumnsOption = Annotated[
    Optional[str],
    typer.Option(
        "--columns", help="The per-step table's columns, comma-separated (e.g. cost_usd,spot_usd,pull_s_max)."
    ),
]

_json_time = TypeAdapter(datetime)

commands = typer.Typer()
"""This module's commands, added to `rlboost` by `infra.cli.app`."""


@commands.command()
def cost(
    run: RunIdOption,
    db: DbOption = None,
    baseline: BaselineOption = None,
    csv_path: CsvOption = None,
    json_path: JsonOption = None,
    predict: PredictOption = False,
    wide: WideOption = False,
    columns: ColumnsOption = None,
) -> None:
    """Cost of a run: per step, per million trained tokens, spot vs reserved, and (--baseline) against a measured reserved-only run."""
    console = Console()
    comparison = prediction = None
    try:
        chosen = step_columns(wide, columns)
    except ValueError as error:
        console.print(str(error), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    from infra.ledger.comparison import BaselineMismatch
    from infra.ledger.db import LedgerUnavailable
    from infra.ledger.reader import UnknownRun
    from infra.ledger.recorder import Ledger
    from infra.pricing import PriceNotFound
    from infra.sim.from_run import Unmappable

    try:
        ledger = Ledger(db, create=False)
        try:
            report = ledger.report(run)
            if baseline is not None:
                comparison = ledger.compare(run, baseline)
        finally:
            ledger.close()
        if predict:
            prediction = _predict(report)
    except (LedgerUnavailable, UnknownRun, PriceNotFound, BaselineMismatch, Unmappable) as error:
        console.print("[red]cost report failed[/red]")
        console.print(str(error), markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1 if isinstance(error, LedgerUnavailable) else 2) from None  # 2: a bad argument
    table = steps_table(report, chosen)
    if wide or columns:  # what was asked for, whole: the terminal may wrap it, but no cell is cut
        needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
        Console(width=max(console.width, needed)).print(table)
    else:
        console.print(table)
    console.print(classes_table(report))
    console.print(summary_table(report))
    if comparison is not None:
        console.print(comparison_table(comparison))
    if prediction is not None:
        console.print(prediction_table(report, prediction))
        console.print(sources_table(prediction))
    if csv_path:
        write_csv(report, csv_path)
        console.print(f"wrote {csv_path}")
    if json_path:
        exported = report.as_dict()
        if comparison is not None:
            exported["comparison"] = comparison.model_dump(mode="json")
        if prediction is not None:
            exported["prediction"] = _prediction_dict(report, prediction)
        json_path.write_text(json.dumps(exported, indent=2) + "\n")
        console.print(f"wrote {json_path}")


def _usd(value: float | None) -> str:
    return "" if value is None else f"{value:,.2f}" if abs(value) >= 100 else f"{value:.4f}"


@dataclass(frozen=True)
class StepColumn:
    """A column of the per-step table: its header, the `StepCost` field (and total-row key) it
    shows, how a value is written, and whether a default (80-column) table has it."""

    header: str
    field: str
    show: Callable[[Any], str]
    essential: bool = False


STEP_COLUMNS = (
    StepColumn("instances", "instances", str),
    StepColumn("inst-s", "instance_seconds", lambda v: f"{v:.0f}"),
    StepColumn("generated", "tokens_generated", str, essential=True),
    StepColumn("wasted", "tokens_wasted", str),
    StepColumn("trained", "tokens_trained", str, essential=True),
    StepColumn("preempted", "preemptions", str, essential=True),
    StepColumn("replaced", "replaced", str),
    StepColumn("cost $", "cost_usd", lambda v: _usd(v), essential=True),
    StepColumn("spot $", "spot_usd", lambda v: _usd(v), essential=True),
    StepColumn("trainer $", "trainer_usd", lambda v: _usd(v)),
    StepColumn("$/M gen", "usd_per_million_generated", lambda v: _usd(v)),
    StepColumn("$/M trained", "usd_per_million_trained", lambda v: _usd(v), essential=True),
    StepColumn("pulled MiB", "transfer_bytes", lambda v: _mib(v)),
    StepColumn("slowest pull s", "pull_s_max", lambda v: _seconds(v)),
)
"""The per-step table's columns after `step`, in order; `rlboost cost` shows the essential ones
unless `--wide` or `--columns` says otherwise (the CSV and JSON exports always have every field)."""


def step_columns(wide: bool = False, names: str | None = None) -> tuple[StepColumn, ...]:
    """The columns `--wide` / `--columns a,b` asks for (by header or field name); ValueError naming
    an unknown one and the choices."""
    if names is None:
        return STEP_COLUMNS if wide else tuple(c for c in STEP_COLUMNS if c.essential)
    by_name = {c.header: c for c in STEP_COLUMNS} | {c.field: c for c in STEP_COLUMNS}
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in by_name]
    if unknown or not wanted:
        choices = ", ".join(c.field for c in STEP_COLUMNS)
        raise ValueError(
            f"--columns: unknown column {', '.join(map(repr, unknown)) or '(none given)'}; choose from {choices}"
        )
    return tuple(dict.fromkeys(by_name[name] for name in wanted))


def steps_table(report: CostReport, columns: tuple[StepColumn, ...] = STEP_COLUMNS) -> Table:
    table = Table(title=f"cost per step of run {report.run_id}")
    table.add_column("step", overflow="fold")  # a line of the books has a name: it wraps, never cut
    for column in columns:
        table.add_column(column.header, justify="right", no_wrap=True)
    for s in report.steps:
        table.add_row(str(s.step), *(column.show(getattr(s, column.field)) for column in columns))
    table.add_section()
    for line in report.unattributed:
        if line.usd or line.instance_seconds:
            cells = {"instance_seconds": f"{line.instance_seconds:.0f}", "cost_usd": _usd(line.usd)}
            table.add_row(line.name, *(cells.get(column.field, "") for column in columns))
    table.add_section()
    total = _total_row(report)
    table.add_row("total", *(column.show(total[column.field]) for column in columns))
    return table


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _slowest_pull(report: CostReport) -> float | None:
    """The seconds of the run's slowest pull over its steps (None: none recorded a time)."""
    return max((s.pull_s_max for s in report.steps if s.pull_s_max is not None), default=None)


def classes_table(report: CostReport) -> Table:
    table = Table(title="spend per capacity class")
    table.add_column("class")
    for header in ("instances", "hours", "spend $", "preempted", "boot s (n)", "boot $"):
        table.add_column(header, justify="right")
    for c in report.classes:
        table.add_row(
            c.capacity_class,
            str(c.instances),
            f"{c.instance_hours:.3f}",
            _usd(c.spend_usd),
            str(c.preemptions),
            "-" if c.boot_s_mean is None else f"{c.boot_s_mean:.1f} ({c.booted})",
            _usd(c.boot_usd),
        )
    return table


def _share(part: float, whole: float) -> str:
    return f" ({part / whole:.0%})" if whole else ""


def summary_table(report: CostReport) -> Table:
    table = Table(title=f"run {report.run_id} ({report.run_name or 'unnamed'}): totals", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    end = report.ended_at or report.as_of
    rows = [
        (
            "period (UTC)",
            f"{report.started_at:%Y-%m-%d %H:%M:%S} -> {end:%Y-%m-%d %H:%M:%S}"
            + ("" if report.ended_at else " (still running)"),
        ),
        ("total $ (instances + egress)", _usd(report.total_usd)),
        ("spot $", _usd(report.spend("spot")) + _share(report.spend("spot"), report.total_usd)),
        ("on-demand $", _usd(report.spend("ondemand")) + _share(report.spend("ondemand"), report.total_usd)),
        ("reserved $", _usd(report.spend("reserved")) + _share(report.spend("reserved"), report.total_usd)),
        (
            "trainer's machine $",
            _usd(report.trainer_usd) + _share(report.trainer_usd, report.total_usd)
            if report.trainer_recorded
            else "not recorded (set ledger.trainer)",
        ),
        ("weight egress $", f"{_usd(report.egress_usd)} ({report.transfer_bytes / 1e9:.2f} GB)"),
        ("in the steps $", _usd(report.attributed_usd) + _share(report.attributed_usd, report.total_usd)),
        *((f"{line.name} $", _usd(line.usd) + _share(line.usd, report.total_usd)) for line in report.unattributed),
        ("tokens generated / trained", f"{report.tokens_generated:,} / {report.tokens_trained:,}"),
        ("tokens wasted", f"{report.tokens_wasted:,}" + _share(report.tokens_wasted, report.tokens_generated)),
        ("$ per million generated tokens", _usd(report.usd_per_million_generated)),
        ("$ per million trained tokens", _usd(report.usd_per_million_trained)),
        ("trained tokens/s (step time)", _rate(report.trained_tokens_per_s)),
        ("preemptions / evictions", f"{report.preemptions} / {report.evictions}"),
    ]
    for what, value in rows:
        table.add_row(what, value)
    return table


def _rate(value: float | None) -> str:
    return "" if value is None else f"{value:,.1f}"


def comparison_table(comparison: BaselineComparison) -> Table:
    """The run beside its measured baseline run (the only comparison with on-demand the ledger makes)."""
    table = Table(title=f"run {comparison.run_id} against a {comparison.basis}")
    table.add_column("what")
    for header in ("this run", "baseline", "ratio"):
        table.add_column(header, justify="right")
    table.add_row("total $", _usd(comparison.total_usd), _usd(comparison.baseline_total_usd), "")
    table.add_row(
        "$ per million trained tokens",
        _usd(comparison.usd_per_million_trained),
        _usd(comparison.baseline_usd_per_million_trained),
        f"{comparison.cost_efficiency:.2f}x tokens per $",
    )
    table.add_row(
        "trained tokens/s",
        _rate(comparison.trained_tokens_per_s),
        _rate(comparison.baseline_trained_tokens_per_s),
        f"{comparison.throughput_ratio:.2f}x",
    )
    return table


def _total_row(report: CostReport) -> dict[str, object]:
    return {
        "step": "total",
        "started_at": _json_time.dump_python(report.started_at, mode="json"),
        "ended_at": _json_time.dump_python(report.ended_at or report.as_of, mode="json"),
        "instances": len(report.instances),
        "instance_seconds": sum(i.billed_seconds for i in report.instances),
        "tokens_generated": report.tokens_generated,
        "tokens_wasted": report.tokens_wasted,
        "tokens_trained": report.tokens_trained,
        "preemptions": report.preemptions,
        "replaced": report.replaced,
        "cost_usd": report.total_usd,
        "spot_usd": report.spend("spot"),
        "trainer_usd": report.trainer_usd,
        "usd_per_million_generated": report.usd_per_million_generated,
        "usd_per_million_trained": report.usd_per_million_trained,
        "transfer_bytes": report.transfer_bytes,
        "pull_s_max": _slowest_pull(report),
    }


def write_csv(report: CostReport, path: Path) -> None:
    """One row per step (the `StepCost` fields), one per line of the books (`step` is its name),
    whose `cost_usd` add up to the final `total` row's."""
    from infra.ledger.report import StepCost

    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(StepCost.model_fields))
        writer.writeheader()
        writer.writerows(step.model_dump(mode="json") for step in report.steps)
        writer.writerows(
            {"step": line.name, "instance_seconds": line.instance_seconds, "cost_usd": line.usd}
            for line in report.unattributed
        )
        writer.writerow(_total_row(report))


def _predict(report: CostReport) -> Prediction:
    from infra.sim import from_run
    from infra.sim.from_run import Unmappable

    try:
        return from_run.predict(report)
    except Unmappable as error:
        raise Unmappable(f"cannot predict run {report.run_id}: {error}") from None


def _measured_and_predicted(report: CostReport, prediction: Prediction) -> list[tuple[str, float | None, float | None]]:
    """(figure, measured, predicted) over the run's ended steps (the simulator models steps only)."""
    ended = [s for s in report.steps if s.ended_at is not None]
    steps_usd = sum(s.cost_usd for s in ended)
    trained = sum(s.tokens_trained for s in ended)
    step_s = sum((s.ended_at - s.started_at).total_seconds() for s in ended if s.ended_at is not None)

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return [
        ("steps", len(ended), prediction.steps),
        ("mean step time (s)", ratio(step_s, len(ended)), ratio(prediction.wall_s, prediction.steps)),
        ("cost per step $", ratio(steps_usd, len(ended)), ratio(prediction.cost_usd, prediction.steps)),
        ("total $ of the steps", steps_usd, prediction.cost_usd),
        ("total $ of the run (with what no step holds)", report.total_usd, None),
        (
            "trained tokens per $ (steps)",
            ratio(trained, steps_usd),
            ratio(prediction.trained_tokens, prediction.cost_usd),
        ),
        (
            "spot share of the steps' $",
            ratio(sum(s.spot_usd for s in ended), steps_usd),
            ratio(prediction.spot_usd, prediction.cost_usd),
        ),
        ("trained tokens/s", ratio(trained, step_s), ratio(prediction.trained_tokens, prediction.wall_s)),
        ("preemptions", report.preemptions, prediction.preemptions),
    ]


def _figure(what: str, value: float | None) -> str:
    if value is None:
        return "not simulated"
    if "share" in what:
        return f"{value:.0%}"
    if what in ("steps", "preemptions"):
        return str(int(value))
    return _usd(value) if "$" in what and "per $" not in what else _rate(value)


def prediction_table(report: CostReport, prediction: Prediction) -> Table:
    """The simulator's prediction for the run's recorded workload beside what the ledger measured."""
    table = Table(title=f"run {report.run_id}: measured by the ledger vs predicted by the simulator")
    table.add_column("what")
    for header in ("measured", "predicted", "predicted / measured"):
        table.add_column(header, justify="right")
    for what, measured, predicted in _measured_and_predicted(report, prediction):
        comparable = measured and predicted is not None and what not in ("steps", "preemptions") and "share" not in what
        share = f"{predicted / measured:.2f}x" if comparable else ""
        table.add_row(what, _figure(what, measured), _figure(what, predicted), share)
    return table


def sources_table(prediction: Prediction) -> Table:
    """Each scenario figure and where it came from: recorded, measured, or the simulator's assumption."""
    table = Table(title="the simulated scenario: what is recorded, measured or assumed")
    for header in ("figure", "value", "source"):
        table.add_column(header)
    for source in prediction.sources:
        table.add_row(source.figure, source.value, source.origin)
    return table


def _prediction_dict(report: CostReport, prediction: Prediction) -> dict[str, object]:
    return {
        "figures": [
            {"what": what, "measured": measured, "predicted": predicted}
            for what, measured, predicted in _measured_and_predicted(report, prediction)
        ],
        "sources": [vars(source) for source in prediction.sources],
        "scenario": prediction.scenario.model_dump(mode="json"),
    }
