"""How a run is shown to people: the live progress bar, per-step and summary tables (rich, and
markdown for Prefect artifacts; the step table's columns are `StepRecord`'s, `infra.run.step_record`;
with `model.lora` the version column reads `adapter version` and
the tables' descriptions say what a version weighs: `table_description`), and the reward/accuracy and
cost curves as a PNG (the cost bars add up to the ledger's total: `cost_bars`)."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn  # noqa: E402
from rich.table import Table  # noqa: E402

from infra.ledger.report import CostReport  # noqa: E402
from infra.run.step_record import History, StepRecord, step_columns  # noqa: E402
from infra.run.workload import AdapterSize  # noqa: E402


def artifact_key(name: str) -> str:
    """A Prefect artifact key from a run name (lowercase letters, digits and dashes)."""
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower())


def step_progress(console: Console | None = None) -> Progress:
    return Progress(
        TextColumn("[bold]GRPO"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def progress_status(history: History) -> str:
    """The progress line's status after a step: reward, held-out accuracy and, on the fabric, the
    run's preemptions and migrations so far as counts (each instance's story is in the run log)."""
    last = history.steps[-1]
    status = f"reward {last.reward:.2f}  held-out acc {history.evals[-1][1]:.2f}"
    if last.preemptions is not None:
        migrated = sum(r.migrations or 0 for r in history.steps)
        status += f"  preempted {last.preemptions}  migrated {migrated}"
    return status


def step_table_rows(records: Sequence[StepRecord], adapters: bool = False) -> list[dict[str, str]]:
    """Rows for a Prefect table artifact (column header -> formatted value), one column per field of
    the record that has a `Column` (`step_columns`); `adapters`: the run's versions are LoRA
    adapters (the columns' `adapter_header`)."""
    return [
        {column.title(adapters): column.text(getattr(record, name)) for name, column in step_columns(type(record))}
        for record in records
    ]


def table_description(text: str, adapter: AdapterSize | None) -> str:
    """A step table's description: `text`, and with `model.lora` (`adapter`: one version's size)
    that its versions are LoRA adapters and what one weighs."""
    if adapter is None:
        return text
    return (
        f"{text}. Versions are LoRA adapters ({adapter.nbytes / 2**20:.2f} MiB, {adapter.parameters:,} parameters each)"
    )


def _number(value: float) -> str:
    """Three decimals, and never `-0.000` (a value that rounds to zero is zero)."""
    return f"{round(value, 3) + 0.0:.3f}"


def summary_table(summary: dict) -> Table:
    table = Table(title=f"rl-train {summary['run']}: summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), _number(value) if isinstance(value, float) else str(value))
    return table


def summary_markdown(summary: dict, plot_path: Path | None) -> str:
    """The run summary as markdown: the metrics table, then the curves PNG embedded as a data URI
    (a Prefect markdown artifact cannot reach files on the machine that ran the flow)."""
    lines = [f"# rl-train {summary['run']}", "", "| metric | value |", "|---|---|"]
    for key, value in summary.items():
        lines.append(
            f"| {key.replace('_', ' ')} | {_number(value)} |"
            if isinstance(value, float)
            else f"| {key.replace('_', ' ')} | {value} |"
        )
    if plot_path:
        encoded = base64.b64encode(Path(plot_path).read_bytes()).decode()
        lines += [
            "",
            "## Reward, accuracy and cost per step",
            "",
            f"![reward, accuracy and cost curves](data:image/png;base64,{encoded})",
            "",
            f"(also at `{plot_path}`)",
        ]
    return "\n".join(lines)


def plot_curves(
    rows: Sequence[StepRecord], evals: list[tuple[int, float]], path: Path, costs: CostReport | None = None
) -> Path:
    """Training reward per step and held-out sampled accuracy per evaluation (top), and the cost
    of each step with the run's cumulative cost (bottom), in one PNG. With the run's `costs`, the
    bottom adds what no step holds (`cost_bars`), so the cumulative line ends at its total."""
    fig, (ax, cost_ax) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=110, height_ratios=(3, 2), sharex=True)
    steps = [r.step for r in rows]
    ax.plot(steps, [r.reward for r in rows], color="#9bb7d4", linewidth=1, label="train reward (batch mean)")
    if len(rows) >= 10:
        window = max(5, len(rows) // 25)
        smooth = [
            sum(r.reward for r in rows[max(0, i - window + 1) : i + 1]) / len(rows[max(0, i - window + 1) : i + 1])
            for i in range(len(rows))
        ]
        ax.plot(steps, smooth, color="#1f5fa8", linewidth=2, label=f"train reward ({window}-step mean)")
    if evals:
        ax.plot(
            [s for s, _ in evals],
            [a for _, a in evals],
            "o-",
            color="#d1495b",
            linewidth=2,
            label="held-out accuracy (T=1)",
        )
    ax.set_ylabel("exact match")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("GRPO: reward, held-out sampled accuracy and cost")
    bars = cost_bars(rows, costs)
    bottom = [0.0] * len(bars.x)
    for label, color, heights in bars.series:
        cost_ax.bar(bars.x, heights, bottom=bottom, color=color, width=1.0, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    cost_ax.set_ylabel("$ per step")
    cost_ax.set_xlabel("RL step (policy version)")
    cost_ax.grid(alpha=0.3)
    total_ax = cost_ax.twinx()
    total_ax.plot(
        bars.x, [sum(bottom[: i + 1]) for i in range(len(bottom))], color="#2e7d32", linewidth=2, label="cumulative ($)"
    )
    total_ax.set_ylabel("cumulative $")
    handles = cost_ax.get_legend_handles_labels()[0] + total_ax.get_legend_handles_labels()[0]
    cost_ax.legend(handles, [h.get_label() for h in handles], loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


@dataclass(frozen=True)
class CostBars:
    """The cost plot's bars: x positions, then (label, colour, height per x) stacked in order."""

    x: list[int]
    series: list[tuple[str, str, list[float]]]


def cost_bars(rows: Sequence[StepRecord], costs: CostReport | None) -> CostBars:
    """Each step's cost (the ledger's where `costs` has the step, else the row's `cost_usd`);
    with `costs`, the gap after each step (`between steps`) on top of it, `before step 1` one
    position before the first step and the report's other lines one after the last: every bar
    summed is `costs.total_usd`."""
    steps = [r.step for r in rows]
    if costs is None:
        return CostBars(steps, [("cost of the step ($)", "#8fbc8f", [r.cost_usd or 0.0 for r in rows])])
    by_step = {s.step: s for s in costs.steps}
    shown = set(steps)
    unplotted = sum(s.cost_usd + s.idle_after_usd for s in costs.steps if s.step not in shown)
    lines = {line.key: line.usd for line in costs.unattributed}
    before = lines.pop("before_step_1") + unplotted
    lines.pop("between_steps")
    x = [steps[0] - 1 if steps else 0, *steps, steps[-1] + 1 if steps else 1]

    def per_step(value) -> list[float]:
        return [0.0, *(value(step) for step in steps), 0.0]

    return CostBars(
        x,
        [
            ("cost of the step ($)", "#8fbc8f", per_step(lambda s: by_step[s].cost_usd if s in by_step else 0.0)),
            ("between steps ($)", "#f0b67f", per_step(lambda s: by_step[s].idle_after_usd if s in by_step else 0.0)),
            ("before step 1 ($)", "#9e9e9e", [before] + [0.0] * (len(x) - 1)),
            ("after the last step, other lines ($)", "#616161", [0.0] * (len(x) - 1) + [sum(lines.values())]),
        ],
    )
