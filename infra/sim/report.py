"""A comparison as a rich table, a JSON-ready dict and a matplotlib PNG (`T_local` per step and
spot instances over time, one line per variant)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from infra.sim.runner import Comparison


def table(comparison: Comparison) -> Table:
    scenario = comparison.scenario
    title = f"{scenario.name}: {scenario.availability.trace or scenario.availability.source}"
    bound = comparison.bound
    if bound is not None:
        title += (
            f"; bound {bound.tokens_per_s:,.0f} tok/s (step {bound.step_s:.0f} s, {bound.limit}-bound; "
            f"{bound.reserved_gpus} reserved + {bound.mean_spot_gpus:.1f} spot GPUs)"
        )
    out = Table(title=title)
    for column in (
        "variant",
        "GPUs res.",
        "spot (mean)",
        "steps",
        "tok/s",
        "x on-demand",
        "$/M tok",
        "tok/$ gain",
        "of bound",
        "wasted",
        "trainer idle",
        "spot idle",
        "preempt.",
    ):
        if column == "variant":  # never cut a variant's name: the figures' headers wrap first
            width = max(len(name) for name in comparison.metrics)
            out.add_column(column, justify="left", no_wrap=True, min_width=width)
        else:
            out.add_column(column, justify="right", min_width=len(column) if column == "x on-demand" else None)
    for m in comparison.metrics.values():
        out.add_row(
            m.variant,
            str(m.reserved_gpus),
            f"{m.mean_spot_instances:.2f}",
            str(m.steps),
            f"{m.tokens_per_s:,.0f}",
            f"{m.throughput_ratio:.2f}",
            f"{m.usd_per_m_tokens:.3f}",
            f"{m.cost_efficiency_gain:+.0%}",
            "-" if m.fraction_of_bound is None else f"{m.fraction_of_bound:.1%}",
            f"{m.waste_fraction:.1%}",
            f"{m.trainer_idle_fraction:.1%}",
            f"{m.spot_idle_fraction:.1%}",
            str(m.preemptions),
        )
    return out


def as_dict(comparison: Comparison) -> dict:
    """Metrics per variant plus the `T_local` trajectory of each (for JSON)."""
    return {
        "scenario": comparison.scenario.name,
        "metrics": {name: asdict(m) for name, m in comparison.metrics.items()},
        "bound": asdict(comparison.bound) if comparison.bound is not None else None,
        "t_local": {
            name: [(round(s.started_at), s.t_local_s) for s in result.steps]
            for name, result in comparison.results.items()
        },
    }


def plot(comparison: Comparison, path: Path) -> Path:
    """Write the PNG: `T_local` per step (top) and spot instances registered (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for name, result in comparison.results.items():
        released = [(s.started_at / 3600, s.t_local_s) for s in result.steps if s.t_local_s is not None]
        if released:
            top.plot(*zip(*released), marker=".", label=name)
        if any(c for _, c in result.instance_counts):
            times = [t / 3600 for t, _ in result.instance_counts] + [result.steps[-1].ended_at / 3600]
            counts = [c for _, c in result.instance_counts] + [result.instance_counts[-1][1]]
            bottom.step(times, counts, where="post", label=name)
    top.set_ylabel("T_local (s)")
    top.legend(loc="upper right", fontsize=8)
    bottom.set_ylabel("spot instances")
    bottom.set_xlabel("simulated time (h)")
    bottom.legend(loc="upper right", fontsize=8)
    fig.suptitle(
        f"{comparison.scenario.name}: {comparison.scenario.availability.trace or comparison.scenario.availability.source}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
