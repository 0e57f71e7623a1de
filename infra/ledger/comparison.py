"""A run against a measured baseline: `compare(report, baseline) -> BaselineComparison`.

The ledger compares with on-demand only against a *reserved-only* run it recorded of the same
workload (the configuration without its spot pools); both are measured, nothing is re-priced.

- `cost_efficiency` = the baseline's $ per million trained tokens / the run's: trained tokens per
  dollar of the run relative to the baseline (1.3: 30 % more tokens per dollar).
- `throughput_ratio` = the run's trained tokens/s / the baseline's (over each run's step time).

Refused with `BaselineMismatch`, saying why and what to do: a baseline with spot instances, one
whose recorded workload (`runs.workload`) differs from the run's in the model, LoRA, data, batch,
trainer (backend, ranks, nodes, machine), optimizer, GRPO settings or any pool but the spot ones
(each differing field named with both values), a run with no workload or none of the trainer's
configuration (recorded before), without the trainer's machine, with no trained tokens or spend,
or the run itself as its own baseline.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from infra.ledger.report import CostReport


class BaselineMismatch(ValueError):
    """The two runs cannot be compared (the message says why and how to fix it)."""


class BaselineComparison(BaseModel):
    basis: str
    """What the comparison is against, as a label: `measured baseline run <id> (<name>)`."""
    run_id: str
    baseline_run_id: str
    total_usd: float
    baseline_total_usd: float
    usd_per_million_trained: float
    baseline_usd_per_million_trained: float
    cost_efficiency: float
    """Baseline $/M trained tokens over the run's: > 1 means more trained tokens per dollar."""
    trained_tokens_per_s: float
    baseline_trained_tokens_per_s: float
    throughput_ratio: float
    """The run's trained tokens/s over the baseline's."""


def _check(report: CostReport, what: str) -> tuple[float, float]:
    """The report's $ per million trained tokens and trained tokens/s, or why they cannot be compared."""
    if not report.trainer_recorded:
        raise BaselineMismatch(
            f"{what} run {report.run_id} did not record the trainer's machine, so its cost leaves the trainer out: "
            f"set ledger.trainer (or use a colocated reserved pool) and record it again"
        )
    if report.usd_per_million_trained is None or report.trained_tokens_per_s is None:
        raise BaselineMismatch(f"{what} run {report.run_id} has no ended step with trained tokens to compare")
    if report.usd_per_million_trained <= 0:
        raise BaselineMismatch(f"{what} run {report.run_id} recorded no spend: its instances' prices are all zero")
    return report.usd_per_million_trained, report.trained_tokens_per_s


COMPARED_SECTIONS = ("model", "lora", "data", "batch", "trainer", "optim", "grpo")
"""Workload sections a baseline must match (`infra.run.workload`); pools are compared apart from spot."""
POOL_FIELDS = ("provider", "capacity_class", "size", "machine_type", "price_per_hour", "colocated")
"""What a baseline's non-spot pools must match, pool by pool (by name)."""
MEASURED_FIELDS = ("data.mean_prompt_tokens",)
"""Workload fields measured at the run's start (over however many held-out prompts it evaluates), not compared."""
_ABSENT = "absent"


def _flatten(name: str, value: Any, flat: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{name}.{key}", item, flat)
    elif name not in MEASURED_FIELDS:
        flat[name] = value


def _flat(workload: dict[str, Any]) -> dict[str, Any]:
    """The compared fields of a workload as dotted names (`trainer.machine.price_per_hour`), its spot
    pools left out."""
    flat: dict[str, Any] = {}
    for section in COMPARED_SECTIONS:
        _flatten(section, workload.get(section), flat)
    for pool in workload.get("pools") or []:
        if pool.get("capacity_class") != "spot":
            flat.update({f"pools.{pool.get('name')}.{field}": pool.get(field) for field in POOL_FIELDS})
    return flat


def workload_differences(run: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    """Each compared field where the two workloads differ, as `field (run: X, baseline: Y)`."""
    ours, theirs = _flat(run), _flat(baseline)
    names = [*ours, *(name for name in theirs if name not in ours)]
    return [
        f"{name} (run: {ours.get(name, _ABSENT)!r}, baseline: {theirs.get(name, _ABSENT)!r})"
        for name in names
        if ours.get(name, _ABSENT) != theirs.get(name, _ABSENT)
    ]


def _check_workloads(report: CostReport, baseline: CostReport) -> None:
    for what, side in (("the", report), ("baseline", baseline)):
        if side.workload is None:
            raise BaselineMismatch(
                f"{what} run {side.run_id} recorded no workload (it was recorded without one, or before ledger "
                f"migration 0004), so the ledger cannot check that both runs ran the same model, batch and pools: "
                f"compare runs recorded since"
            )
        if "backend" not in (side.workload.get("trainer") or {}):
            raise BaselineMismatch(
                f"{what} run {side.run_id} recorded its workload before the trainer's configuration (trainer.backend, "
                f"ranks, optimizer, GRPO settings) was part of it, so the ledger cannot check that both runs trained "
                f"alike: compare runs recorded since"
            )
    differences = workload_differences(report.workload or {}, baseline.workload or {})
    if differences:
        raise BaselineMismatch(
            f"baseline run {baseline.run_id} did not run run {report.run_id}'s workload with its spot pools removed: "
            f"it differs in {'; '.join(differences)}. Fix: name a reserved-only run of the same model, data, batch, "
            f"trainer, optimizer, GRPO settings and pools (the run's configuration without its spot pools)"
        )


def compare(report: CostReport, baseline: CostReport) -> BaselineComparison:
    """`report` against the measured reserved-only `baseline` (see the module docstring)."""
    if report.run_id == baseline.run_id:
        raise BaselineMismatch(f"run {report.run_id} cannot be its own baseline: name a reserved-only run")
    spot = sum(c.instances for c in baseline.classes if c.capacity_class == "spot")
    if spot:
        raise BaselineMismatch(
            f"baseline run {baseline.run_id} ran {spot} spot instance(s): a baseline is a reserved-only run of the "
            f"same configuration (its spot pools removed)"
        )
    _check_workloads(report, baseline)
    usd_per_million, tokens_per_s = _check(report, "the")
    baseline_usd_per_million, baseline_tokens_per_s = _check(baseline, "baseline")
    return BaselineComparison(
        basis=f"measured baseline run {baseline.run_id} ({baseline.run_name or 'unnamed'})",
        run_id=report.run_id,
        baseline_run_id=baseline.run_id,
        total_usd=report.total_usd,
        baseline_total_usd=baseline.total_usd,
        usd_per_million_trained=usd_per_million,
        baseline_usd_per_million_trained=baseline_usd_per_million,
        cost_efficiency=baseline_usd_per_million / usd_per_million,
        trained_tokens_per_s=tokens_per_s,
        baseline_trained_tokens_per_s=baseline_tokens_per_s,
        throughput_ratio=tokens_per_s / baseline_tokens_per_s,
    )
