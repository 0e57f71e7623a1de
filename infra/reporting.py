"""How a run is shown to people: the live progress bar, per-step and summary tables (rich, and
markdown for Prefect artifacts), and the reward/accuracy curve as a PNG."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn  # noqa: E402
from rich.table import Table  # noqa: E402

STEP_COLUMNS = (
    ("step", "step", "{:d}"),
    ("reward", "reward", "{:.3f}"),
    ("accuracy", "train acc", "{:.3f}"),
    ("eval_accuracy", "held-out acc", "{:.3f}"),
    ("tokens", "tokens", "{:d}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("rollout_s", "rollout s", "{:.2f}"),
    ("train_s", "train s", "{:.2f}"),
    ("train_overlap_s", "train during rollout s", "{:.2f}"),
    ("step_s", "step s", "{:.2f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("preemptions", "preemptions", "{:d}"),
    ("migrations", "migrations", "{:d}"),
    ("tokens_wasted", "tokens wasted", "{:d}"),
    ("cost_usd", "cost $", "{:.4f}"),
)


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


def format_value(key: str, value) -> str:
    if value is None:
        return ""
    for column, _, fmt in STEP_COLUMNS:
        if column == key:
            return fmt.format(int(value) if "d}" in fmt else value)
    return str(value)


def step_table_rows(rows: list[dict]) -> list[dict[str, str]]:
    """Rows for a Prefect table artifact (column header -> formatted value)."""
    return [{header: format_value(key, row.get(key)) for key, header, _ in STEP_COLUMNS} for row in rows]


def summary_table(summary: dict) -> Table:
    table = Table(title=f"rl-train {summary['run']}: summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), f"{value:.3f}" if isinstance(value, float) else str(value))
    return table


def summary_markdown(summary: dict, plot_path: Path | None) -> str:
    lines = [f"# rl-train {summary['run']}", "", "| metric | value |", "|---|---|"]
    for key, value in summary.items():
        lines.append(f"| {key.replace('_', ' ')} | {value:.3f} |" if isinstance(value, float) else f"| {key.replace('_', ' ')} | {value} |")
    if plot_path:
        lines += ["", f"Reward and accuracy curves: `{plot_path}`"]
    return "\n".join(lines)


def plot_curves(rows: list[dict], evals: list[tuple[int, float]], path: Path) -> Path:
    """Training reward per step and held-out sampled accuracy per evaluation, in one PNG."""
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["reward"] for r in rows], color="#9bb7d4", linewidth=1, label="train reward (batch mean)")
    if len(rows) >= 10:
        window = max(5, len(rows) // 25)
        smooth = [sum(r["reward"] for r in rows[max(0, i - window + 1): i + 1]) / len(rows[max(0, i - window + 1): i + 1]) for i in range(len(rows))]
        ax.plot(steps, smooth, color="#1f5fa8", linewidth=2, label=f"train reward ({window}-step mean)")
    if evals:
        ax.plot([s for s, _ in evals], [a for _, a in evals], "o-", color="#d1495b", linewidth=2, label="held-out accuracy (T=1)")
    ax.set_xlabel("RL step (policy version)")
    ax.set_ylabel("exact match")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("GRPO: reward and held-out sampled accuracy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
