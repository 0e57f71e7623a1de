"""The run summary (`summarize`): what `rl-train` returns, prints and puts in its summary artifact.
It is computed from the step records and evaluations (`History`), the ledger's cost totals
(`CostReport.summary()`: the cost lines from a microdollar up, `cost_summary`) and the run's own
facts (`RunFacts`: name, length, files, baseline comparison)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.run.step_record import History, StepRecord

FINAL_REWARD_STEPS = 10
"""The final reward is the mean over this many last steps."""


@dataclass(frozen=True)
class RunFacts:
    """What the summary says of the run itself, besides what its steps measured."""

    name: str
    steps: int
    max_staleness: int
    minutes: float
    """Minutes of this invocation of the flow (a resumed run counts from its resumption)."""
    curves_png: Path
    checkpoint: Path
    ledger_run_id: str
    adapter_mib: float | None = None
    """One LoRA adapter version's MiB (None: full fine-tuning)."""
    baseline: Mapping[str, object] = field(default_factory=dict)
    """The comparison with `ledger.baseline_run_id` (`RunAccounting.baseline_summary`), if named."""


def summarize(history: History, costs: Mapping[str, Any], run: RunFacts) -> dict[str, Any]:
    """The run summary: accuracy before and after, the final reward, the tokens generated, the
    staleness figures, the run's minutes and files, the cost lines and the baseline comparison."""
    base, final = history.evals[0][1], history.evals[-1][1]
    last = history.steps[-FINAL_REWARD_STEPS:]
    return {
        "run": run.name,
        "steps": run.steps,
        "base_accuracy": base,
        "final_accuracy": final,
        "gain_points": 100 * (final - base),
        "final_reward": sum(r.reward for r in last) / max(1, len(last)),
        "tokens_generated": sum(r.tokens for r in history.steps),
        **infra_failed_summary(history.steps),
        **staleness_summary(history.steps, run.max_staleness),
        "minutes_this_run": run.minutes,
        **({"adapter_mib_per_version": run.adapter_mib} if run.adapter_mib is not None else {}),
        "curves_png": str(run.curves_png),
        "checkpoint": str(run.checkpoint),
        **cost_summary(costs),
        **run.baseline,
        "ledger_run_id": run.ledger_run_id,
    }


def infra_failed_summary(records: Sequence[StepRecord]) -> dict[str, Any]:
    """The trajectories the infrastructure failed over the run, by kind (`environment`), as
    `infra_failed_<kind>` counts; nothing for a run whose steps counted none (no fabric)."""
    counted = [r.infra_failed for r in records if r.infra_failed is not None]
    if not counted:
        return {}
    kinds = sorted({kind for counts in counted for kind in counts})
    total = {kind: sum(counts.get(kind, 0) for counts in counted) for kind in kinds}
    return {"infra_failed": sum(total.values()), **{f"infra_failed_{kind}": n for kind, n in total.items()}}


def staleness_summary(records: Sequence[StepRecord], max_staleness: int) -> dict[str, Any]:
    """The run's bounded-staleness figures: K, the trained tokens' mean and largest version lag, the
    mean importance weight and truncated fraction, the mean trainer-vs-engine log-prob gap (each
    step weighted by its tokens; a step without a gap counts as 0)."""
    tokens = sum(r.tokens for r in records) or 1

    def weighted(values: list[float]) -> float:
        return sum(r.tokens * value for r, value in zip(records, values)) / tokens

    return {
        "max_staleness": max_staleness,
        "version_lag_mean": weighted([r.version_lag_mean for r in records]),
        "version_lag_max": max((r.version_lag_max for r in records), default=0),
        "is_weight_mean": weighted([r.is_weight_mean for r in records]),
        "is_truncated_fraction": weighted([r.is_truncated_fraction for r in records]),
        "logprob_gap_mean": weighted([r.logprob_gap or 0.0 for r in records]),
    }


def cost_summary(costs: Mapping[str, Any]) -> dict[str, Any]:
    """The cost figures the run summary shows (all of them: `rlboost cost --run <ledger run id>`; the
    comparison with on-demand is against a measured baseline run, `ledger.baseline_run_id`): the
    total, the steps' part (`attributed_usd`) and each line of the rest from a microdollar up: they add up to it."""
    keys = (
        "total_usd",
        "attributed_usd",
        *(
            key
            for key in costs
            if key.startswith("unattributed_") and key != "unattributed_usd" and abs(costs[key]) >= 1e-6
        ),  # under a microdollar: the database's timestamp rounding, not a cost
        "spend_spot_usd",
        "spend_reserved_usd",
        "trainer_usd",
        "usd_per_million_generated",
        "usd_per_million_trained",
        "trained_tokens_per_s",
        "tokens_wasted",
        "preemptions",
    )
    shown = {key: costs[key] for key in keys if costs.get(key) is not None}
    if not costs.get("trainer_recorded"):
        shown["trainer_usd"] = "not recorded: set ledger.trainer (the totals leave the trainer's machine out)"
    return shown
