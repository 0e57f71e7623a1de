"""Simulator benchmark: a CPU check, the RLBoost paper's throughput table, then real spot traces,
each with all variants side by side, single-turn and agentic (`infra.sim`, docs/internals.md §11).

    .venv/bin/python bench/simulate.py [--steps 14] [--warmup 4] [--plots DIR] [--cpu-steps 24] [--no-agentic]

1. **CPU check** (`bench/cpu_profile.py`; needs `rlboost pretrain`; `--cpu-steps 0` skips it).
2. **Paper table**, measured as the artifact measured it (`deployments/sim/paper.yaml`: veRL alone,
   then one instance added every 1800 s, one row per 30-minute window), against its ~10k-18k tok/s.
3. **Real traces**: SkyNomad (`deployments/sim/skynomad.yaml`, two price dates), Bamboo p3, SpotServe;
   each also with multi-turn trajectories (`deployments/sim/skynomad-agentic.yaml`: its `agentic` entry).
The plot goes to `DIR/sim_skynomad.png` (default `runs/simulate/`; `--plots docs` regenerates the
docs' figure). Last line JSON: the paper rows, `cpu_rel_err`, the SkyNomad headline (single-turn,
`async_*`, `agentic_*`) and `traces` (each with its `agentic` entry). Each key and the method:
docs/benchmarks.md; results: docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402

from infra.sim.availability import spot_schedule  # noqa: E402
from infra.sim.report import plot, table  # noqa: E402
from infra.sim.runner import (  # noqa: E402
    ASYNC_K,
    SPECS,
    Comparison,
    Metrics,
    bounded,
    compare,
    equal_cost_spec,
    measure,
    throughput_between,
)
from infra.sim.scenario import Scenario, load_scenario, prices_per_hour  # noqa: E402
from infra.sim.simulator import Simulation  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASYNC_VARIANTS = (*(f"rlboost_async_k{k}" for k in ASYNC_K), "rlboost_async_k2_train_first")
"""The asynchronous variants with spot; the last one's schedule is the simulator's, not the runtime's."""
RUNTIME_ASYNC = tuple(f"rlboost_async_k{k}" for k in ASYNC_K)
PAPER_TOK_S = {0: 10_000, 1: 12_000, 2: 14_000, 3: 16_000, 4: 18_000}
"""The RLBoost artifact's trained tokens/s with 0-4 spot instances (docs/CALIBRATION.md)."""

console = Console(width=160)


def updated(scenario: Scenario, **changes) -> Scenario:
    """`scenario` with top-level fields, or fields of sections (dicts), replaced; validated again."""
    data = scenario.model_dump()
    for name, value in changes.items():
        data[name] = {**(data[name] or {}), **value} if isinstance(value, dict) else value
    return Scenario.model_validate(data)


def paper_rows(steps: int, warmup: int) -> list[dict]:
    """The artifact's table as the artifact measured it: its veRL baseline alone (row 0), then one
    run under its own schedule (an instance added every `add_every_s` up to 4), each row the
    throughput of the steps inside the window with that many instances."""
    base = load_scenario(ROOT / "deployments" / "sim" / "paper.yaml")
    alone = compare(
        updated(
            base,
            spot={"max_instances": 0},
            availability={"source": "constant"},
            run={"max_steps": steps, "measure_from_step": warmup, "variants": ("ondemand",)},
        )
    )
    every = base.availability.add_every_s
    spots = max(PAPER_TOK_S)
    schedule = compare(
        updated(
            base,
            spot={"max_instances": spots},
            run={"duration_s": every * (spots + 1), "variants": ("paper", "rlboost", "rlboost_no_steal")},
        )
    )
    rows = []
    for spot, paper in PAPER_TOK_S.items():
        if spot == 0:
            result, window = alone.results["ondemand"], (0.0, float("inf"))
            sim = alone.metrics["ondemand"].tokens_per_s
            others = {"rlboost_tok_s": sim, "rlboost_no_steal_tok_s": sim}
        else:
            result, window = schedule.results["paper"], (spot * every, (spot + 1) * every)
            sim = throughput_between(result, *window)
            others = {
                f"{name}_tok_s": throughput_between(schedule.results[name], *window)
                for name in ("rlboost", "rlboost_no_steal")
            }
        rows.append(
            {
                "spot": spot,
                "sim_tok_s": round(sim),
                "paper_tok_s": paper,
                "rel_err": round(sim / paper - 1, 3),
                **{k: round(v) for k, v in others.items()},
            }
        )
        measured = [s for s in result.steps if s.started_at >= window[0] and s.ended_at <= window[1]]
        measured = measured[warmup:] if spot == 0 else measured
        step_s = sum(s.ended_at - s.started_at for s in measured) / len(measured)
        console.print(
            f"paper table, {spot} spot: {'ondemand' if spot == 0 else 'paper'} variant {sim:,.0f} prompt+response tok/s "
            f"(artifact ~{paper:,}; {rows[-1]['rel_err']:+.1%}) over {len(measured)} steps; mean step {step_s:.0f} s: "
            f"last sample done at {sum(s.rollout_s for s in measured) / len(measured):.0f} s, training "
            f"{sum(s.train_s for s in measured) / len(measured):.0f} s; rlboost {rows[-1]['rlboost_tok_s']:,} "
            f"(without steal {rows[-1]['rlboost_no_steal_tok_s']:,}); T_local "
            f"{[round(s.t_local_s or 0) for s in measured]}",
            highlight=False,
        )
    return rows


def cpu_check(steps: int, warmup: int, calibration_steps: int) -> dict:
    """Calibrate on this machine (the components alone, and in a calibration run of the fabric
    without its spot pool), predict the demo's steps, run them for real (`bench/cpu_profile.py`)."""
    from bench.cpu_profile import (
        calibrate,
        fabric_profile,
        mean_profile,
        real_run,
        reserved_only,
        scenario_data,
        spot_schedule,
    )
    from infra.run.config import DEFAULT_CONFIG, load_config

    config = load_config(DEFAULT_CONFIG)
    if not (config.model.path / "config.json").exists():
        raise SystemExit(f"{config.model.path} is missing: run `rlboost pretrain` first")
    cores = os.cpu_count() or 1
    started = time.monotonic()
    before = calibrate(config, config.fabric.worker.slots)
    console.print(f"CPU profile measured in {time.monotonic() - started:.0f} s: {before}", highlight=False)
    started = time.monotonic()
    calibration = real_run(calibration_steps, reserved_only(config))
    console.print(
        f"calibration run (spot pool removed) of {calibration_steps} steps in {time.monotonic() - started:.0f} s",
        highlight=False,
    )
    started = time.monotonic()
    rows = real_run(steps)
    console.print(f"real run of {steps} steps in {time.monotonic() - started:.0f} s", highlight=False)
    after = calibrate(config, config.fabric.worker.slots)
    console.print(f"CPU profile measured again: {after}", highlight=False)
    alone = mean_profile(before, after)
    measured = fabric_profile(config, alone, calibration, cores)
    scenario = Scenario.model_validate(scenario_data(config, measured, steps, cores))
    sim = Simulation(scenario, SPECS["rlboost"], spot_schedule(config), prices_per_hour(scenario)[:2]).run()
    prompt_tokens = scenario.workload.prompt_tokens * scenario.workload.prompts_per_step
    prompt_tokens *= scenario.workload.samples_per_prompt
    # the first steps of each side warm up (the spot pool's first workers start); the real last
    # step also evaluates the policy
    predicted = sim.steps[warmup:-1]
    sim_step_s = statistics.fmean(s.ended_at - s.started_at for s in predicted)
    sim_tok_s = sum(s.trained_tokens - prompt_tokens for s in predicted) / sum(
        s.ended_at - s.started_at for s in predicted
    )
    measured_rows = rows[warmup:-1]
    real_step_s = statistics.fmean(r["step_s"] for r in measured_rows)
    real_tok_s = sum(r["tokens"] for r in measured_rows) / sum(r["step_s"] for r in measured_rows)
    figures = {
        "steps": steps,
        "compared_steps": len(measured_rows),
        "sim_step_s": round(sim_step_s, 3),
        "real_step_s": round(real_step_s, 3),
        "step_rel_err": round(sim_step_s / real_step_s - 1, 3),
        "sim_tok_s": round(sim_tok_s, 1),
        "real_tok_s": round(real_tok_s, 1),
        "tok_s_rel_err": round(sim_tok_s / real_tok_s - 1, 3),
        "sim_rollout_s": round(statistics.fmean(s.rollout_s for s in predicted), 3),
        "real_rollout_s": round(statistics.fmean(r["rollout_s"] for r in measured_rows), 3),
        "real_generation_s": round(statistics.fmean(r["rollout_s"] - r["train_overlap_s"] for r in measured_rows), 3),
        "real_step_s_per_step": [round(r["step_s"], 2) for r in measured_rows],
        "sim_preemptions": sim.preemptions,
        "real_preemptions": rows[-1].get("preemptions", 0),  # a step's metrics count the run's so far
        "calibration_step_s": round(statistics.fmean(r["step_s"] for r in calibration[1:-1]), 3),
        "profile": {k: round(v, 7) if isinstance(v, float) else v for k, v in measured.items()},
        "alone": {k: round(alone[k], 7) for k in ("decode_step_s", "train_s_per_token")},
        "train_s_per_token_before_after": [round(before["train_s_per_token"], 7), round(after["train_s_per_token"], 7)],
        "decode_step_s_before_after": [round(before["decode_step_s"], 7), round(after["decode_step_s"], 7)],
    }
    console.print(f"CPU check: {figures}", highlight=False)
    return figures


def best_async(m: dict[str, Metrics], names: tuple[str, ...]) -> str:
    """The variant of `names` with the most tokens per second (the smaller K, then the runtime's, on a tie)."""
    return max(names, key=lambda name: (m[name].tokens_per_s, -m[name].max_staleness, -names.index(name)))


def async_figures(comparison: Comparison) -> dict:
    """The asynchronous variants against `ondemand` (the best of them, and the best the runtime
    runs today), the reserved cluster alone made asynchronous, and the work-conservation bounds."""
    m, bound = comparison.metrics, comparison.bound
    assert bound is not None
    name = best_async(m, ASYNC_VARIANTS)
    best, runtime = m[name], m[best_async(m, RUNTIME_ASYNC)]
    alone = max((m[f"ondemand_async_k{k}"] for k in ASYNC_K), key=lambda x: x.tokens_per_s)
    return {
        "async_throughput_ratio": round(best.throughput_ratio, 3),
        "async_cost_efficiency_gain": round(best.cost_efficiency_gain, 3),
        "async_fraction_of_bound": round(best.fraction_of_bound or 0.0, 3),
        "async_fraction_of_kv_bound": round(best.tokens_per_s / bound.tokens_per_s_kv, 3),
        "async_k": best.max_staleness,
        "async_variant": name,
        "async_runtime_throughput_ratio": round(runtime.throughput_ratio, 3),
        "async_runtime_cost_efficiency_gain": round(runtime.cost_efficiency_gain, 3),
        "async_runtime_fraction_of_bound": round(runtime.fraction_of_bound or 0.0, 3),
        "ondemand_async_ratio": round(alone.throughput_ratio, 3),
        "ondemand_async_k": alone.max_staleness,
        "bound_throughput_ratio": round(bound.tokens_per_s / m["ondemand"].tokens_per_s, 3),
        "kv_bound_throughput_ratio": round(bound.tokens_per_s_kv / m["ondemand"].tokens_per_s, 3),
        "async_fraction_of_unbanked_bound": round(best.tokens_per_s / bound.tokens_per_s_unbanked, 3),
        "async_train_fraction": round(best.train_fraction, 3),
        "async_spot_idle_fraction": round(best.spot_idle_fraction, 3),
        "bound": bound_figures(comparison),
        "fraction_of_bound": {name: round(x.fraction_of_bound or 0.0, 3) for name, x in m.items()},
        "async_by_variant": {
            name: {
                "throughput_ratio": round(m[name].throughput_ratio, 3),
                "cost_efficiency_gain": round(m[name].cost_efficiency_gain, 3),
                "fraction_of_bound": round(m[name].fraction_of_bound or 0.0, 3),
            }
            for name in ASYNC_VARIANTS
        },
        "ondemand_async_by_k": {k: round(m[f"ondemand_async_k{k}"].throughput_ratio, 3) for k in ASYNC_K},
    }


def bound_figures(comparison: Comparison) -> dict:
    """The work-conservation bound's terms (`WorkBound`)."""
    bound = comparison.bound
    assert bound is not None
    return {
        "tok_s": round(bound.tokens_per_s),
        "unbanked_tok_s": round(bound.tokens_per_s_unbanked),
        "kv_tok_s": round(bound.tokens_per_s_kv),
        "step_s": round(bound.step_s, 1),
        "limit": bound.limit,
        "reserved_gpus": bound.reserved_gpus,
        "mean_spot_gpus": round(bound.mean_spot_gpus, 2),
        "rollout_gpu_s": round(bound.rollout_gpu_s_spot),
        "train_gpu_s": round(bound.train_gpu_s),
    }


def agentic_figures(comparison: Comparison) -> dict:
    """Multi-turn trajectories: `rlboost` on-policy and the best `rlboost_async_k{1,2}` against
    `ondemand` (and against `restart` and `paper`), how much `restart` wastes, and the bound."""
    m, bound, results = comparison.metrics, comparison.bound, comparison.results
    assert bound is not None
    rl = m["rlboost"]
    best = m[best_async(m, RUNTIME_ASYNC)]
    return {
        "throughput_ratio": round(rl.throughput_ratio, 3),
        "cost_efficiency_gain": round(rl.cost_efficiency_gain, 3),
        "fraction_of_bound": round(rl.fraction_of_bound or 0.0, 3),
        "async_throughput_ratio": round(best.throughput_ratio, 3),
        "async_cost_efficiency_gain": round(best.cost_efficiency_gain, 3),
        "async_fraction_of_bound": round(best.fraction_of_bound or 0.0, 3),
        "async_fraction_of_kv_bound": round(best.tokens_per_s / bound.tokens_per_s_kv, 3),
        "async_k": best.max_staleness,
        "vs_restart": round(rl.tokens_per_s / m["restart"].tokens_per_s, 3),
        "vs_paper_choices": round(rl.tokens_per_s / m["paper"].tokens_per_s, 3),
        "async_vs_restart": round(best.tokens_per_s / m["restart"].tokens_per_s, 3),
        "restart_throughput_ratio": round(m["restart"].throughput_ratio, 3),
        "restart_cost_efficiency_gain": round(m["restart"].cost_efficiency_gain, 3),
        "restart_waste_fraction": round(m["restart"].waste_fraction, 4),
        "paper_throughput_ratio": round(m["paper"].throughput_ratio, 3),
        "paper_cost_efficiency_gain": round(m["paper"].cost_efficiency_gain, 3),
        "paper_replayed_tool_calls": results["paper"].replayed_tool_calls,
        "rlboost_waste_fraction": round(rl.waste_fraction, 4),
        "bound_throughput_ratio": round(bound.tokens_per_s / m["ondemand"].tokens_per_s, 3),
        "kv_bound_throughput_ratio": round(bound.tokens_per_s_kv / m["ondemand"].tokens_per_s, 3),
        "ondemand_tok_s": round(m["ondemand"].tokens_per_s),
        "mean_spot_instances": round(rl.mean_spot_instances, 2),
        "preemptions": rl.preemptions,
        "bound": bound_figures(comparison),
    }


def figures(comparison: Comparison, label: str, prices_at: str | None) -> dict:
    m = comparison.metrics
    rl = m["rlboost"]
    return {
        "trace": label,
        "prices_at": prices_at,
        "throughput_ratio": round(rl.throughput_ratio, 3),
        "cost_efficiency_gain": round(rl.cost_efficiency_gain, 3),
        "vs_paper_choices": round(rl.tokens_per_s / m["paper"].tokens_per_s, 3),
        "vs_restart": round(rl.tokens_per_s / m["restart"].tokens_per_s, 3),
        "no_steal_throughput_ratio": round(m["rlboost_no_steal"].throughput_ratio, 3),
        "no_steal_cost_efficiency_gain": round(m["rlboost_no_steal"].cost_efficiency_gain, 3),
        "paper_throughput_ratio": round(m["paper"].throughput_ratio, 3),
        "paper_cost_efficiency_gain": round(m["paper"].cost_efficiency_gain, 3),
        "equal_cost_throughput_ratio": round(m["ondemand_equal_cost"].throughput_ratio, 3),
        "rlboost_waste_fraction": round(rl.waste_fraction, 4),
        "restart_waste_fraction": round(m["restart"].waste_fraction, 4),
        "mean_spot_instances": round(rl.mean_spot_instances, 2),
        "preemptions": rl.preemptions,
        "egress_usd_per_step": round(rl.egress_usd_per_step, 4),
        **marginal_figures(m["rlboost_marginal"]),
        **async_figures(comparison),
    }


def marginal_figures(marginal: Metrics) -> dict:
    """The `marginal` capacity policy's figures (`rlboost_marginal`), beside `rlboost`'s (`budget`)."""
    return {
        "marginal_throughput_ratio": round(marginal.throughput_ratio, 3),
        "marginal_cost_efficiency_gain": round(marginal.cost_efficiency_gain, 3),
        "marginal_mean_spot_instances": round(marginal.mean_spot_instances, 2),
        "marginal_egress_usd_per_step": round(marginal.egress_usd_per_step, 4),
    }


def repriced(comparison: Comparison, prices_at: str) -> Comparison:
    """The same runs at another date's catalog prices (prices do not change the dynamics of the
    budget policy's variants); the equal-cost cluster is sized again for the new spend, and it
    and the marginal policy's variant (whose decisions read the prices) are simulated again."""
    scenario = updated(comparison.scenario, run={"prices_at": prices_at})
    reserved, spot, _ = prices_per_hour(scenario)
    schedule = spot_schedule(scenario)
    again = {"ondemand_equal_cost", "rlboost_marginal"} & comparison.results.keys()
    results = {
        name: replace(r, spot_price_per_hour=spot, reserved_price_per_hour=reserved)
        for name, r in comparison.results.items()
        if name not in again
    }
    if "rlboost_marginal" in again:
        results["rlboost_marginal"] = Simulation(scenario, SPECS["rlboost_marginal"], schedule, (reserved, spot)).run()
    metrics: dict = {}
    for name, result in results.items():
        metrics[name] = measure(result, scenario.run.measure_from_step, metrics.get("ondemand"))
    if "ondemand_equal_cost" in again:
        spec = equal_cost_spec(scenario, reserved, metrics["rlboost"], spot)
        results[spec.name] = Simulation(scenario, spec, schedule, (reserved, spot)).run()
        metrics[spec.name] = measure(results[spec.name], scenario.run.measure_from_step, metrics["ondemand"])
    return bounded(scenario, results, metrics, schedule)


TRACES: tuple[tuple[str, dict], ...] = (
    ("skynomad/h100/us-central1-b", {}),
    ("bamboo/p3", {"spot": {"provider": "gcp", "notice_s": 120.0}, "availability": {"trace": "bamboo/p3"}}),
    ("spotserve/0304", {"spot": {"notice_s": 120.0}, "availability": {"trace": "spotserve/0304"}}),
)
"""Each trace's changes to the SkyNomad scenarios (its name is derived from the trace)."""
LATER_PRICES = "2026-07-20T00:00:00Z"


def trace_scenario(base: Scenario, label: str, changes: dict) -> Scenario:
    """`base` (a SkyNomad scenario) on the trace `label` (`TRACES`), named after it."""
    if not changes:
        return base
    name = label.replace("/", "-") + ("-agentic" if base.agentic is not None else "")
    return updated(base, name=name, **changes)


def run_trace(label: str, changes: dict, agentic: bool, plots: Path | None) -> list[dict]:
    """The trace's entries: single-turn and (with `agentic`) agentic variants at 2025-10-10 prices,
    and for SkyNomad (`plots` given) the same at the July 2026 prices."""
    single = compare(trace_scenario(load_scenario(ROOT / "deployments" / "sim" / "skynomad.yaml"), label, changes))
    console.print(table(single))
    many = None
    if agentic:
        many = compare(
            trace_scenario(load_scenario(ROOT / "deployments" / "sim" / "skynomad-agentic.yaml"), label, changes)
        )
        console.print(table(many))
    entries = [{**figures(single, label, "2025-10-10"), **({"agentic": agentic_figures(many)} if many else {})}]
    if plots is not None:
        plot(single, plots / "sim_skynomad.png")
        later = repriced(single, LATER_PRICES)
        console.print(table(later))
        entry = figures(later, label, "2026-07-20")
        if many is not None:
            entry["agentic"] = agentic_figures(repriced(many, LATER_PRICES))
        entries.append(entry)
    return entries


HEADLINE = (
    "async_throughput_ratio",
    "async_cost_efficiency_gain",
    "async_fraction_of_bound",
    "async_fraction_of_kv_bound",
    "async_k",
    "async_variant",
    "async_runtime_throughput_ratio",
    "ondemand_async_ratio",
    "bound_throughput_ratio",
    "kv_bound_throughput_ratio",
)


def headline(traces: list[dict]) -> dict:
    """The SkyNomad figures at 2025-10-10 prices, the agentic ones also at July 2026's."""
    now, later = traces[0], traces[1]
    out = {
        "throughput_ratio": now["throughput_ratio"],
        "cost_efficiency_gain": now["cost_efficiency_gain"],
        "vs_paper_choices": now["vs_paper_choices"],
        "vs_restart": now["vs_restart"],
        **{key: now[key] for key in HEADLINE},
    }
    if "agentic" in now:
        agentic, july = now["agentic"], later["agentic"]
        for key in ("throughput_ratio", "cost_efficiency_gain", "async_throughput_ratio", "async_cost_efficiency_gain"):
            out[f"agentic_{key}"] = agentic[key]
        for key in (
            "fraction_of_bound",
            "async_fraction_of_bound",
            "restart_waste_fraction",
            "vs_restart",
            "vs_paper_choices",
            "bound_throughput_ratio",
        ):
            out[f"agentic_{key}"] = agentic[key]
        out["agentic_cost_efficiency_gain_2026_07"] = july["cost_efficiency_gain"]
        out["agentic_async_cost_efficiency_gain_2026_07"] = july["async_cost_efficiency_gain"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=14, help="steps per paper-table row")
    parser.add_argument("--warmup", type=int, default=4, help="paper-table steps not measured")
    parser.add_argument(
        "--plots",
        type=Path,
        default=ROOT / "runs" / "simulate",
        help="folder of the plot (docs: regenerate the docs' figure)",
    )
    parser.add_argument("--cpu-steps", type=int, default=24, help="steps of the CPU check's real run (0: skip it)")
    parser.add_argument("--cpu-warmup", type=int, default=4, help="first steps of each side not compared")
    parser.add_argument("--cpu-calibration-steps", type=int, default=12, help="steps of the calibration run")
    parser.add_argument("--no-agentic", dest="agentic", action="store_false", help="skip the agentic variants")
    args = parser.parse_args()
    cpu = cpu_check(args.cpu_steps, args.cpu_warmup, args.cpu_calibration_steps) if args.cpu_steps else None
    started = time.monotonic()
    rows = paper_rows(args.steps, args.warmup)
    console.print(f"paper table simulated in {time.monotonic() - started:.0f} s", highlight=False)
    traces: list[dict] = []
    for label, changes in TRACES:
        traces += run_trace(label, changes, args.agentic, args.plots if not traces else None)
    console.print(
        f"simulated in {time.monotonic() - started:.0f} s; plot {args.plots / 'sim_skynomad.png'}", highlight=False
    )
    print(
        json.dumps(
            {
                "paper_rows": rows,
                "paper_max_rel_err": max(abs(r["rel_err"]) for r in rows),
                "cpu_rel_err": cpu["step_rel_err"] if cpu else None,
                "cpu_check": cpu,
                **headline(traces),
                "wall_s": round(time.monotonic() - started),
                "traces": traces,
            }
        )
    )


if __name__ == "__main__":
    main()
