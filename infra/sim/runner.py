"""The variants of one scenario side by side: same trace, same seed, same response lengths.

`SPECS`: `ondemand` (the reserved cluster alone, veRL's loop: on-policy, old log-probs recomputed,
no spot), `rlboost` (this project: spot instances, token-level migration, steal, swarm weight pull),
`rlboost_no_steal`, `rlboost_marginal` (holding only the spot instances worth their price),
`paper` (the paper's choices: group-min truncation, weights from the trainer's senders only, no
steal, the artifact's offload rule), `restart` (a sample that leaves an instance starts over),
`rlboost_async_k1`/`_k2` (`rlboost` at staleness K), `ondemand_async_k1`/`_k2` (without spot);
`equal_cost_spec` adds `ondemand_equal_cost`, a reserved cluster grown in whole engines to what
`rlboost` spent per hour. This project's variants skip the old-log-prob forward
(`VariantSpec.recompute_logprobs`); `rlboost`, `rlboost_no_steal` and `restart` run the scenario's
`training.max_staleness`. `compare` runs them; `measure` gives `Metrics` from `run.measure_from_step`
on (trained tokens/s; dollars: the reserved cluster, each spot instance from request to end, the
egress of its weight pulls; ratios against `ondemand`); `work_bound` is what no schedule beats.
Detail: docs/internals.md §11, docs/simulator.md ("Variants").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from infra.availability.traces import TraceSchedule
from infra.sim.agentic import DecodeWork, decode_work, trajectories
from infra.sim.availability import spot_schedule
from infra.sim.hardware import DecodeModel
from infra.sim.scenario import Scenario, Variant, prices_per_hour
from infra.sim.simulator import (
    RunResult,
    Simulation,
    VariantSpec,
    cluster_train_seconds,
    decode_model,
    response_lengths,
)

ASYNC_K = (1, 2)
"""The staleness bounds of the asynchronous variants."""

SPECS: dict[str, VariantSpec] = {
    "ondemand": VariantSpec("ondemand", use_spot=False, max_staleness=0, recompute_logprobs=True),
    "rlboost": VariantSpec("rlboost", use_spot=True, migration="token", steal=True, swarm=True),
    "rlboost_no_steal": VariantSpec("rlboost_no_steal", use_spot=True, migration="token", steal=False, swarm=True),
    "rlboost_marginal": VariantSpec("rlboost_marginal", use_spot=True, capacity="marginal"),
    "paper": VariantSpec(
        "paper",
        use_spot=True,
        migration="group_min",
        steal=False,
        swarm=False,
        offload="artifact",
        max_staleness=0,
        recompute_logprobs=True,
    ),
    "restart": VariantSpec("restart", use_spot=True, migration="restart", steal=False, swarm=True),
    **{f"rlboost_async_k{k}": VariantSpec(f"rlboost_async_k{k}", use_spot=True, max_staleness=k) for k in ASYNC_K},
    "rlboost_async_k2_train_first": VariantSpec(
        "rlboost_async_k2_train_first", use_spot=True, max_staleness=2, train_first=True
    ),
    **{f"ondemand_async_k{k}": VariantSpec(f"ondemand_async_k{k}", use_spot=False, max_staleness=k) for k in ASYNC_K},
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
    train_fraction: float = 0.0
    """Time the reserved cluster spent training, over the wall time (1: training-bound)."""
    max_staleness: int = 0
    fraction_of_bound: float | None = None
    """Trained tokens/s over the scenario's work-conservation bound (`WorkBound`)."""
    egress_usd: float = 0.0
    """Egress of the spot instances' weight pulls in the window (part of `cost_usd`)."""
    egress_usd_per_step: float = 0.0
    """`egress_usd` over the measured steps."""


@dataclass(frozen=True)
class WorkBound:
    """The best throughput any schedule could reach on a scenario's trace (work conservation):
    the reserved GPUs' seconds plus the spot GPUs' seconds the trace makes available on average,
    against one step's rollout and training work, each at its best. Rollout costs, on an engine
    of `g` GPUs, ``g * (a * steps + c * N + b * C + prefill)`` GPU-seconds for N model tokens whose
    contexts sum to C (a response of L tokens after a prompt of P: ``L * P + L**2 / 2``; a
    trajectory's turns also read its earlier turns and tool results), the prompts and tool
    results prefilled once, no re-prefill; ``steps = N / slots``: every decode step of a full
    engine (the `hardware` roofline). Training costs the reserved cluster `cluster_train_seconds`
    (this project's trainer: no old-log-prob forward) and runs on the reserved GPUs only. With
    `R_r`, `R_s` the rollout GPU-seconds on reserved or spot engines, `T` the training
    GPU-seconds, `G_r` and `G_s` the GPUs: the step takes at least ``t* = max(T / G_r, min(R_s /
    G_s, (R_r + T) / (G_r + G_s R_r / R_s)))``, the reserved GPUs training and generating what
    the spot GPUs cannot. Nothing else is charged (boot, weight pulls, claim delays, tool calls,
    the tail of a step, the orchestration), so no variant can beat it."""

    tokens_per_step: float
    rollout_gpu_s_reserved: float
    """One step's rollout on reserved engines, GPU-seconds."""
    rollout_gpu_s_spot: float
    """The same on spot engines."""
    train_gpu_s: float
    reserved_gpus: int
    mean_spot_gpus: float
    """Spot GPUs the trace makes available, time-averaged over the window (boots included)."""
    step_s: float
    tokens_per_s: float
    limit: str
    """What binds: `training` (the trainer is never idle), `spot` (every spot GPU generates
    and the reserved GPUs only train) or `all` (every GPU busy)."""
    tokens_per_s_unbanked: float = 0.0
    """The same bound when work cannot move between periods of different spot capacity: the
    time average of the bound at each capacity the trace holds (a schedule whose rollout runs
    at most K steps ahead of the trainer cannot bank a long surplus for a later shortage)."""
    tokens_per_s_kv: float = 0.0
    """The same bound (banked) with decode at the batch the KV cache allows: a decode step reads
    at most the cache's capacity of context, so an engine type takes at least ``max(N / slots, C /
    capacity)`` steps, not ``N / slots`` (`slots` sizes concurrency for a mean context; a sample's
    context grows as it decodes). At most `tokens_per_s`: the part of a variant's gap to that bound
    which no schedule on engines that respect their KV cache could close."""


def rollout_gpu_seconds(scenario: Scenario, decode: DecodeModel, work: DecodeWork, kv: bool = False) -> float:
    """GPU-seconds of decoding `work` on engines like `decode`, at their best (full engines, each
    prompt and tool result prefilled once); with `kv`, no decode step past the KV cache's capacity."""
    slots = decode.slots(scenario.mean_context())
    a, c = decode.seconds_per_step_base, decode.seconds_per_step_per_running
    b = decode.seconds_per_step_per_context_token
    steps = work.tokens / slots
    if kv:
        steps = max(steps, work.context_tokens / decode.kv_capacity_tokens)
    return decode.gpus * (
        a * steps + c * work.tokens + b * work.context_tokens + decode.prefill_seconds(work.prefill_tokens)
    )


def step_work(scenario: Scenario, step: int) -> tuple[float, DecodeWork]:
    """`step`'s trained tokens (as the variants count them) and its decode work."""
    w = scenario.workload
    prompt = w.prompt_tokens if scenario.training.count_prompt_tokens else 0
    if scenario.agentic is None:
        lengths = response_lengths(scenario, step)
        return sum(lengths) + prompt * len(lengths), decode_work(w.prompt_tokens, ((n,) for n in lengths))
    plans = trajectories(scenario, step)
    tokens = sum(p.model_tokens + sum(p.observation_tokens) for p in plans) + prompt * len(plans)
    return tokens, decode_work(w.prompt_tokens, plans)


def capacity_durations(schedule: TraceSchedule, pool: int, start_s: float, end_s: float) -> dict[int, float]:
    """Seconds of `[start_s, end_s]` the schedule spends at each capacity (at most `pool`)."""
    if pool == 0:
        return {0: max(0.0, end_s - start_s)}
    durations: dict[int, float] = {}
    t, capacity = start_s, min(pool, schedule.capacity_at(start_s))
    for change in schedule.events_between(start_s, end_s):
        durations[capacity] = durations.get(capacity, 0.0) + change.t - t
        t, capacity = change.t, min(pool, change.capacity)
    durations[capacity] = durations.get(capacity, 0.0) + end_s - t
    return durations


def mean_capacity(schedule: TraceSchedule, pool: int, start_s: float, end_s: float) -> float:
    """Spot instances the schedule allows, time-averaged over `[start_s, end_s]`."""
    if end_s <= start_s or pool == 0:
        return 0.0
    durations = capacity_durations(schedule, pool, start_s, end_s)
    return sum(capacity * seconds for capacity, seconds in durations.items()) / (end_s - start_s)


def work_bound(
    scenario: Scenario, steps: Iterable[int], schedule: TraceSchedule, window: tuple[float, float]
) -> WorkBound:
    """`WorkBound` of `scenario` for the mean work of `steps`, with the spot capacity `schedule`
    allows over `window` (wall seconds)."""
    reserved, spot = scenario.reserved, scenario.spot
    engines = (
        decode_model(scenario, "reserved", reserved.engine_gpus, reserved.max_running),
        decode_model(scenario, "spot", spot.gpus, spot.max_running),
    )
    tokens, count = 0.0, 0
    rollout = [0.0, 0.0, 0.0, 0.0]
    """Reserved, spot; then both again at the KV cache's batch."""
    for step in steps:
        trained, work = step_work(scenario, step)
        tokens += trained
        for i, (engine, kv) in enumerate(((e, kv) for kv in (False, True) for e in engines)):
            rollout[i] += rollout_gpu_seconds(scenario, engine, work, kv)
        count += 1
    if count == 0:
        raise ValueError("the bound needs at least one step")
    tokens = tokens / count
    r_r, r_s, r_r_kv, r_s_kv = (r / count for r in rollout)
    g_r = reserved.gpus
    train = cluster_train_seconds(scenario, tokens, g_r, recompute_logprobs=False) * g_r
    g_s = mean_capacity(schedule, spot.max_instances, *window) * spot.gpus
    step_s, limit = _bound_step(r_r, r_s, train, g_r, g_s)
    start, end = window
    unbanked = 0.0
    if end > start:
        for capacity, seconds in capacity_durations(schedule, spot.max_instances, start, end).items():
            unbanked += seconds * tokens / _bound_step(r_r, r_s, train, g_r, capacity * spot.gpus)[0]
        unbanked /= end - start
    kv_step_s = _bound_step(r_r_kv, r_s_kv, train, g_r, g_s)[0]
    return WorkBound(tokens, r_r, r_s, train, g_r, g_s, step_s, tokens / step_s, limit, unbanked, tokens / kv_step_s)


def _bound_step(r_r: float, r_s: float, train: float, g_r: float, g_s: float) -> tuple[float, str]:
    """`WorkBound`'s ``t*`` for rollout GPU-seconds `r_r`/`r_s`, training `train` and the GPUs."""
    shared = (r_r + train) / (g_r + g_s * r_r / r_s) if g_s > 0 else (r_r + train) / g_r
    spot_alone = r_s / g_s if g_s > 0 else math.inf
    step_s = max(train / g_r, min(shared, spot_alone))
    return step_s, "training" if step_s == train / g_r else ("all" if shared <= spot_alone else "spot")


@dataclass(frozen=True)
class Comparison:
    scenario: Scenario
    results: dict[str, RunResult]
    metrics: dict[str, Metrics]
    bound: WorkBound | None = None


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
    pulled = sum(nbytes for t, nbytes in result.pulls if lo <= t < hi)
    egress = pulled / 1e9 * result.egress_usd_per_gb
    cost = (result.reserved_price_per_hour * wall + result.spot_price_per_hour * spot_s) / 3600 + egress
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
        train_fraction=sum(s.train_s for s in measured) / wall,
        max_staleness=result.max_staleness,
        egress_usd=egress,
        egress_usd_per_step=egress / len(measured) if measured else 0.0,
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
        "ondemand_equal_cost",
        use_spot=False,
        reserved_gpus=gpus,
        reserved_price_per_hour=gpus * per_gpu,
        max_staleness=0,
        recompute_logprobs=True,
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
    return bounded(scenario, results, metrics, schedule)


def bounded(
    scenario: Scenario, results: dict[str, RunResult], metrics: dict[str, Metrics], schedule: TraceSchedule
) -> Comparison:
    """The comparison with its `WorkBound` (the mean work of every step any variant measured,
    the spot capacity over the union of their windows) and each variant's fraction of it."""
    from_step = scenario.run.measure_from_step
    windows = [_window(r, from_step) for r in results.values()]
    last = max(len(r.steps) for r in results.values())
    bound = work_bound(
        scenario,
        range(min(from_step, last - 1), last),
        schedule,
        (min(lo for lo, _ in windows), max(hi for _, hi in windows)),
    )
    metrics = {name: replace(m, fraction_of_bound=m.tokens_per_s / bound.tokens_per_s) for name, m in metrics.items()}
    return Comparison(scenario, results, metrics, bound)
