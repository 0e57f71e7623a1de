"""The variants of one scenario side by side: same trace, same seed, same response lengths.

* `ondemand`: the reserved cluster alone (the baseline; it never releases: no spot instance);
* `rlboost` (this project): spot instances, token-level migration, steal, swarm weight pull;
* `rlboost_no_steal`: the same without steal (what steal adds or costs);
* `paper` (the RLBoost paper's choices where they differ): group-min truncation on preemption,
  weights only from the trainer's senders, no steal, and the artifact's own offload rule (a fixed
  local generation budget per step, `infra.sim.artifact_offload`);
* `restart`: spot instances without a token log: a sample that leaves an instance starts over;
* `ondemand_equal_cost`: a larger reserved cluster costing what `rlboost` spent per hour (whole
  engines of the reserved kind, priced per GPU like the reserved cluster).

`Metrics` are measured from step `run.measure_from_step` on: trained tokens per second of wall
time, dollars (reserved cluster for the whole window, each spot instance from request to end),
ratios against `ondemand`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.sim.availability import spot_schedule
from infra.sim.scenario import Scenario, Variant, prices_per_hour
from infra.sim.simulator import RunResult, Simulation, VariantSpec

SPECS: dict[str, VariantSpec] = {
    "ondemand": VariantSpec("ondemand", use_spot=False),
    "rlboost": VariantSpec("rlboost", use_spot=True, migration="token", steal=True, swarm=True),
    "rlboost_no_steal": VariantSpec("rlboost_no_steal", use_spot=True, migration="token", steal=False, swarm=True),
    "paper": VariantSpec("paper", use_spot=True, migration="group_min", steal=False, swarm=False, offload="artifact"),
    "restart": VariantSpec("restart", use_spot=True, migration="restart", steal=False, swarm=True),
}


@dataclass(frozen=True)
class Metrics:
    """One variant's figures over the measured window."""

    variant: str
    wall_s: float
    steps: int
    trained_tokens: float
    tokens_per_s: float
    cost_usd: float
    usd_per_m_tokens: float
    throughput_ratio: float
    """Trained tokens/s over `ondemand`'s."""
    cost_efficiency_gain: float
    """Trained tokens per dollar over `ondemand`'s, minus 1."""
    generated_tokens: float
    wasted_tokens: float
    waste_fraction: float
    trainer_idle_fraction: float
    """Time the reserved cluster waited for groups after releasing, over the wall time."""
    spot_idle_fraction: float
    """Billed spot time with no sample running (booting, pulling, waiting for the next step)."""
    mean_spot_instances: float
    """Time-averaged spot instances registered."""
    preemptions: int
    reserved_gpus: int


@dataclass(frozen=True)
class Comparison:
    scenario: Scenario
    results: dict[str, RunResult]
    metrics: dict[str, Metrics]


def _window(result: RunResult, from_step: int) -> tuple[float, float]:
    measured = result.steps[min(from_step, len(result.steps) - 1) :]
    return measured[0].started_at, measured[-1].ended_at


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def measure(result: RunResult, from_step: int, baseline: Metrics | None) -> Metrics:
    """`result`'s figures over its steps from `from_step` on (the last step if it ran fewer)."""
    lo, hi = _window(result, from_step)
    wall = hi - lo
    measured = [s for s in result.steps if s.started_at >= lo]
    tokens = sum(s.trained_tokens for s in measured)
    spot_s = sum(_overlap(a, b, lo, hi) for a, b in result.spot_intervals)
    cost = (result.reserved_price_per_hour * wall + result.spot_price_per_hour * spot_s) / 3600
    counts = result.instance_counts + [(hi, result.instance_counts[-1][1])]
    spot_mean = sum(c * _overlap(t0, t1, lo, hi) for (t0, c), (t1, _) in zip(counts, counts[1:])) / wall
    all_spot_s = sum(b - a for a, b in result.spot_intervals)
    rate = tokens / wall
    per_usd = tokens / cost if cost > 0 else math.inf
    return Metrics(
        variant=result.variant,
        wall_s=wall,
        steps=len(measured),
        trained_tokens=tokens,
        tokens_per_s=rate,
        cost_usd=cost,
        usd_per_m_tokens=cost / tokens * 1e6,
        throughput_ratio=rate / baseline.tokens_per_s if baseline else 1.0,
        cost_efficiency_gain=per_usd / (baseline.trained_tokens / baseline.cost_usd) - 1 if baseline else 0.0,
        generated_tokens=result.generated_tokens,
        wasted_tokens=result.wasted_tokens,
        waste_fraction=result.wasted_tokens / result.generated_tokens if result.generated_tokens else 0.0,
        trainer_idle_fraction=sum(s.trainer_idle_s for s in measured) / wall,
        spot_idle_fraction=1 - result.spot_busy_s / all_spot_s if all_spot_s else 0.0,
        mean_spot_instances=spot_mean,
        preemptions=result.preemptions,
        reserved_gpus=result.reserved_gpus,
    )


def throughput_between(result: RunResult, start_s: float, end_s: float) -> float:
    """Trained tokens per second of the steps that ran entirely within `[start_s, end_s)` (a window
    of a run, as the RLBoost artifact's table reads its run: one row per 30 minutes)."""
    steps = [s for s in result.steps if s.started_at >= start_s and s.ended_at <= end_s]
    if not steps:
        raise ValueError(f"{result.variant}: no step ran entirely within [{start_s:g}, {end_s:g}) s")
    return sum(s.trained_tokens for s in steps) / sum(s.ended_at - s.started_at for s in steps)


def equal_cost_spec(
    scenario: Scenario, reserved_price: float, rlboost: Metrics | None, spot_price: float
) -> VariantSpec:
    """The reserved cluster grown, in whole engines, to `rlboost`'s spend per hour (or, without
    it, to the full spot pool's price)."""
    reserved = scenario.reserved
    extra = (
        (rlboost.cost_usd / rlboost.wall_s * 3600 - reserved_price)
        if rlboost
        else spot_price * scenario.spot.max_instances
    )
    per_gpu = reserved_price / reserved.gpus
    engines = math.floor((reserved_price + max(0.0, extra)) / per_gpu / reserved.engine_gpus + 1e-9)
    gpus = max(reserved.engine_gpus, engines * reserved.engine_gpus)
    return VariantSpec(
        "ondemand_equal_cost", use_spot=False, reserved_gpus=gpus, reserved_price_per_hour=gpus * per_gpu
    )


def compare(scenario: Scenario) -> Comparison:
    """Run every variant of `scenario.run.variants` (and `ondemand`) on the same schedule."""
    schedule = spot_schedule(scenario)
    reserved_price, spot_price, _ = prices_per_hour(scenario)
    wanted: list[Variant] = ["ondemand"] + [v for v in scenario.run.variants if v != "ondemand"]
    results: dict[str, RunResult] = {}
    metrics: dict[str, Metrics] = {}
    from_step = scenario.run.measure_from_step
    for name in wanted:
        if name == "ondemand_equal_cost":
            spec = equal_cost_spec(scenario, reserved_price, metrics.get("rlboost"), spot_price)
        else:
            spec = SPECS[name]
        result = Simulation(scenario, spec, schedule, (reserved_price, spot_price)).run()
        results[name] = result
        metrics[name] = measure(result, from_step, metrics.get("ondemand"))
    return Comparison(scenario, results, metrics)
