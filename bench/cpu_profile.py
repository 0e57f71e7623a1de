"""The CPU check of `bench/simulate.py` (issue 15 item 4): calibrate the simulator on this machine,
predict the demo configuration's steps, then run the same configuration for real and compare.
No command of its own: `bench/simulate.py --cpu-steps N` runs it (`--cpu-steps 0` skips it).

1. **Calibrate**: `calibrate` times the components alone (right before and right after the real
   run, `mean_profile` averaging the two): the workers' HF engine's decode steps (a least-squares
   line, fixed + per-context-token seconds), prefill and response lengths, the torch trainer per
   trained token, a worker's start-up; `fabric_profile` then brings them to the speeds the runtime
   reaches in its own fabric, from a calibration run without the spot pool (`reserved_only`).
2. **Predict**: `scenario_data` makes the demo configuration a scenario with that `measured`
   profile, every time stretched by `busy_processes` over the cores.
3. **Run**: `real_run`, `rlboost train` on the same configuration, read step by step.
What the prediction leaves out is reported, not fitted. The method in full: docs/benchmarks.md
("How each benchmark measures"); the figures: docs/simulator.md ("Against this machine").
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope of y against x."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return max(my - slope * mx, 1e-6), max(slope, 0.0)


def calibrate(config, slots: int) -> dict:
    """Measured speeds of the demo's engine and trainer on this machine (see the module docstring)."""
    import torch

    from rl.engine import HFEngine
    from rl.models import load_model, load_tokenizer
    from rl.prompt_source import PromptSource
    from rl.rollout import build_requests
    from rl.trainer import TrainBatch, Trainer

    path = config.model.path
    tokenizer = load_tokenizer(path)
    records = PromptSource(config.data).take(0, config.rollout.prompts_per_step)
    requests = build_requests(tokenizer, records, 1, config.rollout, config.run.seed)
    model = load_model(path)[0].eval()
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    trainer_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker's engine (`infra.rollout.worker.TORCH_THREADS`)
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_size=slots, device="cpu")
    engine.generate(requests[:8])  # warm-up
    points, prefill = [], []
    for batch in (1, 4, 16, slots // 2, slots):
        context = {r.sample_id: len(r.prompt_ids) for r in requests[:batch]}
        for request in requests[:batch]:
            engine.add(request)
        started = time.perf_counter()
        chunks = engine.step()  # the batch's prefill, then its first token
        first = time.perf_counter() - started
        decode = []
        while True:
            for chunk in chunks:
                context[chunk.sample_id] += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    del context[chunk.sample_id]
            if not engine.has_work():
                break
            running = sum(context.values())
            started = time.perf_counter()
            chunks = engine.step()
            decode.append(time.perf_counter() - started)
            points.append((running, decode[-1]))
        prompt_tokens = sum(len(r.prompt_ids) for r in requests[:batch])
        prefill.append((prompt_tokens, first - (statistics.median(decode) if decode else 0.0)))
    step_s, per_context_token_s = _fit_line(points)
    prefill_s_per_token = max(0.0, sum(s for _, s in prefill) / sum(t for t, _ in prefill))
    results = engine.generate(requests)
    lengths = [len(r.token_ids) for r in results]
    torch.set_num_threads(trainer_threads)
    trainer = Trainer(
        load_model(path)[0],
        tokenizer.pad_token_id,
        config.grpo,
        config.optim,
        temperature=config.rollout.temperature,
        gradient_checkpointing=config.trainer.gradient_checkpointing,
    )
    batch = TrainBatch(
        [list(r.prompt_ids) for r in requests],
        [list(r.token_ids) for r in results],
        [list(r.new_logprobs) for r in results],
        [1.0 if i % 2 else -1.0 for i in range(len(results))],
    )
    trained = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    trainer.train_step(batch)  # warm-up
    seconds = []
    for _ in range(4):
        started = time.perf_counter()
        trainer.train_step(batch)
        seconds.append(time.perf_counter() - started)
    started = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import infra.rollout.worker; from rl.models import load_model; load_model({str(path)!r})",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
    )
    boot_s = time.perf_counter() - started
    return {
        "decode_step_s": step_s,
        "decode_s_per_context_token": per_context_token_s,
        "prefill_s_per_token": prefill_s_per_token,
        "train_s_per_token": statistics.median(seconds) / trained,
        "prompt_tokens": statistics.fmean(len(r.prompt_ids) for r in requests),
        "mean_response_tokens": statistics.fmean(lengths),
        "response_cv": statistics.pstdev(lengths) / statistics.fmean(lengths),
        "boot_s": boot_s,
        "trainer_threads": trainer_threads,
        "slots": slots,
        "params": params,
        "bytes_per_param": weight_bytes // params,
    }


def fabric_profile(config, alone: dict, rows: list[dict], cores: int) -> dict:
    """The components-alone profile `alone` brought to the speeds of the runtime's own fabric on
    this machine, from `rows`, the metrics of a calibration run with the spot pool removed (its
    first step, which starts the run, and its last, which evaluates, are left out): the trainer's
    seconds per trained token (prompt and response tokens, as the simulator counts them), the
    step's serial tail after the rollout, and a factor on the engine's decode and prefill times,
    the run's generation time over the one the simulator predicts for it from `alone`."""
    from infra.sim.runner import SPECS
    from infra.sim.scenario import Scenario, prices_per_hour
    from infra.sim.simulator import Simulation

    steady = rows[1:-1]
    prompt_tokens = alone["prompt_tokens"] * config.rollout.prompts_per_step * config.rollout.group_size
    scenario = Scenario.model_validate(scenario_data(config, alone, len(rows), cores, with_spot=False))
    predicted = Simulation(scenario, SPECS["ondemand"], spot_schedule(config), prices_per_hour(scenario)[:2]).run()
    generation = statistics.median(r["rollout_s"] - r["train_overlap_s"] for r in steady)
    scale = generation / statistics.median(s.rollout_s for s in predicted.steps[1:-1])
    return {
        **alone,
        **{k: alone[k] * scale for k in ("decode_step_s", "decode_s_per_context_token", "prefill_s_per_token")},
        "train_s_per_token": statistics.median(r["train_overlap_s"] / (r["tokens"] + prompt_tokens) for r in steady),
        "step_overhead_s": statistics.median(r["step_s"] - r["rollout_s"] for r in steady),
        "engine_scale": scale,
        "in_fabric": True,
    }


def mean_profile(before: dict, after: dict) -> dict:
    """The two calibrations around the real run, averaged: the machine's load changes within
    seconds (other users), so neither alone stands for the run between them."""
    return {k: (before[k] + after[k]) / 2 if isinstance(before[k], float) else before[k] for k in before}


def _spot_pool(config):
    return next(p for p in config.fabric.pools if p.capacity_class == "spot")


def busy_processes(config, measured: dict, with_spot: bool) -> float:
    """Processes computing at once, on average: the trainer's process (its threads while training,
    its engine's one while generating) and, `with_spot`, the spot workers alive (one thread each,
    for the mean share of the Poisson schedule they are up)."""
    trainer = (measured["trainer_threads"] + 1) / 2
    if not with_spot:
        return trainer
    spot = _spot_pool(config)
    poisson = spot.availability.poisson
    return trainer + spot.size * poisson.mean_life_s / (poisson.mean_life_s + poisson.mean_gap_s)


def scenario_data(config, measured: dict, steps: int, cores: int, with_spot: bool = True) -> dict:
    """The demo configuration as a simulator scenario with the measured profile (`with_spot=False`:
    its spot pool removed, as the calibration run has it). A profile measured in the fabric
    (`fabric_profile`) already holds its calibration run's core sharing: only what the spot pool
    adds stretches it."""
    spot = _spot_pool(config)
    busy = busy_processes(config, measured, with_spot)
    if measured.get("in_fabric"):
        calibration_slowdown = max(1.0, busy_processes(config, measured, False) / cores)
        busy = cores * max(1.0, busy / cores) / calibration_slowdown
    controller = config.fabric.controller
    return {
        "name": "demo-cpu",
        "seed": config.run.seed,
        # the weights the spot workers pull each step (the decode and training speeds are measured)
        "model": {"params_b": measured["params"] / 1e9, "bytes_per_value": measured["bytes_per_param"]},
        "workload": {
            "prompts_per_step": config.rollout.prompts_per_step,
            "samples_per_prompt": config.rollout.group_size,
            "prompt_tokens": round(measured["prompt_tokens"]),
            "mean_response_tokens": measured["mean_response_tokens"],
            "response_cv": max(measured["response_cv"], 0.01),
            "max_response_tokens": config.rollout.max_new_tokens,
        },
        "measured": {
            **{k: measured[k] for k in ("decode_step_s", "decode_s_per_context_token", "prefill_s_per_token")},
            "train_s_per_token": measured["train_s_per_token"],
            "cores": cores,
            "busy_processes": busy,
        },
        "training": {
            "count_prompt_tokens": True,
            "while_generating": config.fabric.stream_training,
            "micro_batch_samples": config.optim.micro_batch_size,
            "step_overhead_s": measured.get("step_overhead_s", 0.0),
            "max_staleness": config.training.max_staleness,  # the run's bounded staleness (0: on-policy)
        },
        "reserved": {"gpus": 1, "engine_gpus": 1, "max_running": measured["slots"], "price_per_hour": 3.67},
        "spot": {
            "gpus": 1,
            "max_running": measured["slots"],
            "max_instances": spot.size if with_spot else 0,
            "price_per_hour": spot.price_per_hour,
            "ondemand_price_per_hour": 3.67,
            "boot_s": measured["boot_s"],
            "notice_s": spot.notice_s,
            "silent_fraction": spot.silent_kill_fraction,
        },
        "network": {"local_sync_s": 0.0, "trainer_gbps": 10.0, "instance_gbps": 10.0},
        "controller": controller.model_dump(),
        "run": {"duration_s": 1e6, "max_steps": steps, "variants": ["rlboost"]},
    }


def spot_schedule(config):
    """The spot pool's own capacity schedule (what its local pool replays)."""
    spot = _spot_pool(config)
    return spot.availability.schedule(spot.size)


def reserved_only(config) -> str:
    """A `--set` override that keeps only the configuration's reserved pool."""
    pools = [
        p.model_dump(mode="json", exclude_defaults=True) for p in config.fabric.pools if p.capacity_class == "reserved"
    ]
    return "fabric.pools=" + json.dumps(pools)


def real_run(steps: int, *extra: str) -> list[dict]:
    """`rlboost train` of the demo configuration for `steps` steps (with `extra` `--set`
    overrides); each step's metrics row."""
    name = f"cpu-check-{uuid.uuid4().hex[:6]}"
    overrides = [
        f"run.name={name}",
        f"run.steps={steps}",
        f"run.checkpoint_every={steps}",
        f"eval.every={steps + 1}",
        *extra,
    ]
    command = [sys.executable, "-m", "infra.cli.app", "train"]
    for override in overrides:
        command += ["--set", override]
    subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    steps_dir = ROOT / "runs" / name / "steps"
    return [json.loads((d / "metrics.json").read_text()) for d in sorted(steps_dir.iterdir())]
