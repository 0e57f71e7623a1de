"""A recorded run as a simulator scenario, and the simulator's prediction for it (`rlboost cost --predict`).

`scenario_of(report)` maps a run's ledger report (its recorded workload, `runs.workload`, and its
measured figures) to a `Scenario`, and says where each figure came from (`Source`: `recorded` in
the workload, `measured` by the ledger (prices, mean spot boot seconds), or the simulator's
`assumed` default); `predict(report)` runs it (this project's runtime, `rlboost`; without spot
pools the reserved cluster alone) for the run's number of ended steps. Machine types map to the GPUs they carry (`MACHINE_GPUS`); the
reserved cluster is the trainer's machine.
A run that cannot be mapped (no workload, an unknown machine type, ...) raises `Unmappable`, its
message one line saying why and what would fix it. Local pools are processes standing for their
machine types: the prediction is for those machines, not for this host.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import TypeAdapter, ValidationError

from infra.availability.traces import TraceSchedule
from infra.ledger.config import trainer_machine
from infra.providers.pool import PoissonAvailability, TraceAvailability
from infra.run.config import ConfigError
from infra.sim.availability import spot_schedule
from infra.sim.runner import SPECS, measure
from infra.sim.scenario import Scenario, SpotSection, parse_scenario
from infra.sim.simulator import Simulation

if TYPE_CHECKING:
    from infra.ledger.report import CostReport

MACHINE_GPUS: dict[str, tuple[str, int]] = {
    **{f"a2-highgpu-{n}g": ("A100-40G", n) for n in (1, 2, 4, 8)},
    "a2-megagpu-16g": ("A100-40G", 16),
    **{f"a2-ultragpu-{n}g": ("A100-80G", n) for n in (1, 2, 4, 8)},
    **{f"a3-highgpu-{n}g": ("H100", n) for n in (1, 2, 4, 8)},
    "a3-megagpu-8g": ("H100", 8),
    "a3-edgegpu-8g": ("H100", 8),
    **{f"g2-standard-{n}": ("L4", 1) for n in (4, 8, 12, 16, 32)},
    "g2-standard-24": ("L4", 2),
    "g2-standard-48": ("L4", 4),
    "g2-standard-96": ("L4", 8),
    "Standard_NC24ads_A100_v4": ("A100-80G", 1),
    "Standard_NC48ads_A100_v4": ("A100-80G", 2),
    "Standard_NC96ads_A100_v4": ("A100-80G", 4),
    "Standard_ND96asr_v4": ("A100-40G", 8),
    "Standard_ND96amsr_A100_v4": ("A100-80G", 8),
    "Standard_NC40ads_H100_v5": ("H100", 1),
    "Standard_NC80adis_H100_v5": ("H100", 2),
    "Standard_ND96isr_H100_v5": ("H100", 8),
}
"""GPU type (`infra.sim.hardware.GPUS`) and count of each machine type the simulator can model."""
BYTES_PER_VALUE = {"fp32": 4, "bf16": 2, "fp16": 2}
PROMPT_TOKENS = 512
"""Prompt length assumed for a run that recorded none (the scenario's default)."""
DEFAULT_BOOT_S: float = SpotSection.model_fields["boot_s"].default
"""Spot boot seconds assumed for a run that recorded no ready times (the scenario's default)."""
_availability = TypeAdapter(TraceAvailability | PoissonAvailability)


class Unmappable(ValueError):
    """The run cannot be mapped to a scenario (the message says why, on one line)."""


@dataclass(frozen=True)
class Source:
    """Where one scenario figure came from."""

    figure: str
    value: str
    origin: Literal["recorded", "measured", "assumed"]


@dataclass(frozen=True)
class Prediction:
    """The simulator's figures for the run's steps, beside the report they predict."""

    scenario: Scenario
    sources: list[Source]
    steps: int
    wall_s: float
    cost_usd: float
    spot_usd: float
    trained_tokens: float
    preemptions: int


def _gpus(machine_type: str, what: str) -> tuple[str, int]:
    if machine_type not in MACHINE_GPUS:
        raise Unmappable(
            f"{what} is machine type {machine_type!r}, which the simulator cannot model: it knows "
            f"{', '.join(sorted(MACHINE_GPUS))}"
        )
    return MACHINE_GPUS[machine_type]


def _model(workload: dict[str, Any], sources: list[Source]) -> dict[str, Any]:
    model = workload.get("model") or {}
    missing = [key for key in ("params", "layers", "kv_heads", "head_dim", "hidden_size") if not model.get(key)]
    if missing:
        raise Unmappable(
            f"the recorded model ({model.get('path')}) lacks {', '.join(missing)} (no config.json architecture, or "
            f"no parameter count: a DeepSpeed trainer's ranks hold the model), so its size cannot be simulated"
        )
    shape = {
        "params_b": model["params"] / 1e9,
        "layers": model["layers"],
        "kv_heads": model["kv_heads"],
        "head_dim": model["head_dim"],
        "hidden_size": model["hidden_size"],
        "bytes_per_value": BYTES_PER_VALUE.get(model.get("dtype"), 2),
    }
    sources.append(
        Source("model", f"{model['path']}: {model['params']:,} params, {model['layers']} layers", "recorded")
    )
    lora = workload.get("lora")
    if lora and lora.get("trainable_parameters"):
        shape["lora"] = {"trainable_fraction": lora["trainable_parameters"] / model["params"]}
        if lora.get("adapter_bytes"):
            shape["lora"]["adapter_bytes"] = lora["adapter_bytes"]
        sources.append(
            Source(
                "LoRA adapters",
                f"r {lora['r']}: {lora['trainable_parameters']:,} trainable params, {lora.get('adapter_bytes') or 0:,} bytes a version",
                "recorded",
            )
        )
    return shape


def _pools(workload: dict[str, Any], report: CostReport, sources: list[Source]) -> tuple[dict, dict, Any]:
    """(reserved section, spot section, the spot pool's availability or None)."""
    pools = workload.get("pools") or []
    trainer_pool = next((p for p in pools if p.get("colocated")), None)
    trainer = trainer_machine(workload) or trainer_pool
    if trainer is None:
        raise Unmappable("the run recorded no trainer's machine (ledger.trainer or a colocated pool) to simulate")
    others = [p["name"] for p in pools if p.get("capacity_class") != "spot" and not p.get("colocated")]
    if others:
        raise Unmappable(
            f"pool(s) {', '.join(others)} generate on reserved or on-demand machines apart from the trainer's: the "
            f"simulator's reserved cluster is the trainer's machine only"
        )
    gpu, count = _gpus(trainer["machine_type"], "the trainer's machine")
    prices = {i.role: i.usd_per_hour for i in report.instances}
    reserved_price = prices.get("trainer", trainer["price_per_hour"])
    reserved = {"gpu": gpu, "gpus": count, "engine_gpus": 1, "price_per_hour": reserved_price}
    sources.append(Source("reserved", f"{trainer['machine_type']}: {count} x {gpu}, ${reserved_price}/h", "recorded"))
    if "local" in {p.get("provider") for p in pools} | {trainer.get("provider")}:
        sources.append(
            Source("hardware", "the machine types' GPUs (the run's machines were local processes)", "assumed")
        )
    if trainer_pool is None:
        sources.append(Source("reserved generates", "co-located until T_local (the run's trainer did not)", "assumed"))
    spots = [p for p in pools if p.get("capacity_class") == "spot"]
    if len({p["machine_type"] for p in spots}) > 1:
        raise Unmappable("the run's spot pools run several machine types; the simulator models one")
    if not spots:
        return reserved, {"max_instances": 0, "price_per_hour": 0.0, "ondemand_price_per_hour": reserved_price}, None
    pool = spots[0]
    gpu, count = _gpus(pool["machine_type"], f"spot pool {pool['name']}")
    size = sum(p["size"] for p in spots)
    spot_prices = [i.usd_per_hour for i in report.instances if i.capacity_class == "spot"]
    price = sum(spot_prices) / len(spot_prices) if spot_prices else pool["price_per_hour"]
    spot = {
        "gpu": gpu,
        "gpus": count,
        "max_instances": size,
        "price_per_hour": price,
        "ondemand_price_per_hour": reserved_price,
        "notice_s": pool.get("notice_s"),
        "silent_fraction": pool.get("silent_kill_fraction", 0.0),
    }
    origin = "measured" if spot_prices else "recorded"
    sources.append(Source("spot", f"{size} x {pool['machine_type']} ({count} x {gpu}), ${price:.4f}/h", origin))
    sources.append(Source("spot notice", f"{spot['notice_s']} s, {spot['silent_fraction']:.0%} silent", "recorded"))
    booted = next((c for c in report.classes if c.capacity_class == "spot" and c.boot_s_mean is not None), None)
    if booted is not None:
        spot["boot_s"] = booted.boot_s_mean
        sources.append(Source("spot boot", f"{booted.boot_s_mean:.1f} s (mean of {booted.booted} boots)", "measured"))
    else:
        sources.append(Source("spot boot", f"{DEFAULT_BOOT_S:.0f} s (the run recorded no ready times)", "assumed"))
    return reserved, spot, pool.get("availability")


def scenario_of(report: CostReport) -> tuple[Scenario, TraceSchedule, list[Source]]:
    """The run of `report` as a scenario, its spot capacity schedule, and each figure's source."""
    workload = report.workload
    if workload is None:
        raise Unmappable(
            f"run {report.run_id} recorded no workload (recorded before ledger migration 0004, or without one)"
        )
    ended = [s for s in report.steps if s.ended_at is not None]
    batch = workload.get("batch") or {}
    samples = len(ended) * batch.get("prompts_per_step", 0) * batch.get("group_size", 0)
    trained = sum(s.tokens_trained for s in ended)
    if not samples or not trained:
        raise Unmappable(f"run {report.run_id} has no ended step with trained tokens to predict")
    sources: list[Source] = []
    model = _model(workload, sources)
    reserved, spot, availability = _pools(workload, report, sources)
    mean_response = trained / samples
    prompt_tokens = (workload.get("data") or {}).get("mean_prompt_tokens")
    if prompt_tokens:
        prompt_source = Source(
            "prompt tokens", f"{prompt_tokens:.1f} (mean of the encoded held-out prompts)", "recorded"
        )
    else:
        prompt_tokens = PROMPT_TOKENS
        prompt_source = Source("prompt tokens", f"{PROMPT_TOKENS} (the run recorded no prompt length)", "assumed")
    sources += [
        Source("batch", f"{batch['prompts_per_step']} prompts x {batch['group_size']} samples", "recorded"),
        Source("response budget", f"{batch['max_new_tokens']} tokens", "recorded"),
        Source("mean response", f"{mean_response:.1f} tokens (trained tokens / samples)", "measured"),
        Source("steps", str(len(ended)), "measured"),
        prompt_source,
        Source("response spread", "log-normal, cv 1.2", "assumed"),
        Source("speeds", "GPU roofline: decode eta 0.69, training MFU 0.28", "assumed"),
    ]
    data = {
        "name": f"run {report.run_id}",
        "model": model,
        "workload": {
            "prompts_per_step": batch["prompts_per_step"],
            "samples_per_prompt": batch["group_size"],
            "prompt_tokens": max(1, round(prompt_tokens)),
            "mean_response_tokens": mean_response,
            "max_response_tokens": batch["max_new_tokens"],
        },
        "training": {"max_staleness": batch.get("max_staleness", 0), "count_prompt_tokens": False},
        "reserved": reserved,
        "spot": {k: v for k, v in spot.items() if v is not None},
        "availability": {"source": "constant"},
        "run": {"duration_s": 1e7, "max_steps": len(ended), "variants": ["rlboost"]},
    }
    try:
        scenario = parse_scenario(json.dumps(data), f"run {report.run_id}'s scenario")
    except ConfigError as error:
        raise Unmappable("; ".join(str(error).splitlines())) from None
    if availability is None:
        schedule = spot_schedule(scenario)
        if spot["max_instances"]:
            sources.append(Source("spot capacity", "always available (the pool recorded no availability)", "assumed"))
    else:
        try:
            schedule = _availability.validate_python(availability).schedule(spot["max_instances"])
        except ValidationError as error:
            raise Unmappable(
                f"the spot pool's recorded availability is not valid: {error.errors()[0]['msg']}"
            ) from None
        sources.append(Source("spot capacity", f"the pool's own schedule: {json.dumps(availability)}", "recorded"))
    return scenario, schedule, sources


def predict(report: CostReport) -> Prediction:
    """The simulator's figures for the run of `report` (see the module docstring)."""
    scenario, schedule, sources = scenario_of(report)
    reserved, spot = scenario.reserved.price_per_hour, scenario.spot.price_per_hour
    result = Simulation(scenario, SPECS["rlboost"], schedule, (reserved or 0.0, spot or 0.0)).run()
    metrics = measure(result, 0, None)
    lo, hi = result.steps[0].started_at, result.steps[-1].ended_at
    spot_s = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in result.spot_intervals)
    return Prediction(
        scenario=scenario,
        sources=sources,
        steps=metrics.steps,
        wall_s=metrics.wall_s,
        cost_usd=metrics.cost_usd,
        spot_usd=result.spot_price_per_hour * spot_s / 3600,
        trained_tokens=metrics.trained_tokens,
        preemptions=result.preemptions,
    )
