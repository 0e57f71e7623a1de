"""The CPU check of `bench/simulate.py` (issue 15 item 4): calibrate the simulator on this machine,
predict the demo configuration's steps, then run the same configuration for real and compare.

1. **Calibrate** (in this process, right before and right after the real run, the two profiles
   averaged: other users load the machine and its load changes within seconds, so the
   calibration brackets the run as closely as it can): on the demo's base model and one
   step's real prompts, the HF engine the workers run (1 torch thread, as a worker has) times its
   decode steps over batches of 1 to `slots` samples (a least-squares line of step time against
   the tokens of context: fixed + per-context-token seconds), its prefill per prompt token, and
   the response lengths it draws (mean and coefficient of variation); the torch trainer (the
   trainer's thread count) times GRPO updates on those samples, per trained token; and a fresh
   worker process's start-up to a loaded model is timed as the spot instance's boot. The step's
   orchestration (`orchestration_seconds`) is timed by its parts: Prefect's cost of an
   `rl-step`-shaped subflow (its five task runs and the rollout's progress artifact, doing no
   work, timed from inside as `step_s` is), the session's scoring of one step's samples, and the
   ledger's recording of a step (a `RunAccounting` on SQLite, as the demo's run has).
2. **Predict** (after the run, from the averaged profile): `deployments/configs/demo.yaml` as a scenario with that `measured` profile: one
   co-located reserved engine and two spot workers of `slots` samples, the pools' Poisson
   schedule (the same `PoissonLifetimes` the local pool replays), notice, silent-kill fraction,
   reap timeout and `T_local` settings, the trainer's micro-batch (`optim.micro_batch_size`: the
   demo's 256 is the whole step, so streamed training starts once every group is complete) and
   the measured orchestration as the step's serial overhead. On 2 cores the trainer's process
   (2 threads while training, 1 while its engine generates) and the live spot workers (1 thread
   each) share the cores: every measured time stretches by their mean count over the cores.
3. **Run**: `rlboost train` on the same configuration for `--cpu-steps` steps (no evaluation but
   the last step's, no checkpoint but the last), and read each step's `step_s`, `rollout_s` and
   tokens. Both sides are compared over the steps between the first (workers starting) and the
   last (it evaluates).

What the prediction leaves out is reported, not fitted: publishing a version (its snapshot in
the engines' dtype; ~10 ms a step here) and the co-located engine's sleep and wake.
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
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_size=slots)
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
    trainer = Trainer(load_model(path)[0], tokenizer.pad_token_id, config.grpo, config.optim)
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
    orchestration = orchestration_seconds(config, tokenizer, records, requests, results)
    return {
        "decode_step_s": step_s,
        "decode_s_per_context_token": per_context_token_s,
        "prefill_s_per_token": prefill_s_per_token,
        "train_s_per_token": statistics.median(seconds) / trained,
        "prompt_tokens": statistics.fmean(len(r.prompt_ids) for r in requests),
        "mean_response_tokens": statistics.fmean(lengths),
        "response_cv": statistics.pstdev(lengths) / statistics.fmean(lengths),
        "boot_s": boot_s,
        **orchestration,
        "trainer_threads": trainer_threads,
        "slots": slots,
        "params": params,
        "bytes_per_param": weight_bytes // params,
    }


def orchestration_seconds(config, tokenizer, records, requests, results) -> dict:
    """A step's serial work outside rollout and training, by its parts (module docstring)."""
    import tempfile

    from infra.ledger import Ledger
    from infra.run.accounting import RunAccounting
    from rl.rewards import make_reward_fn
    from rl.rollout import samples_from_results
    from rl.scoring import score_samples

    samples = samples_from_results(requests, results, 0)
    reward = make_reward_fn(config.reward.kind)
    started = time.perf_counter()
    for _ in range(5):
        score_samples(samples, records, tokenizer, reward, reward, config.rollout.group_size, config.grpo)
    score_s = (time.perf_counter() - started) / 5
    with tempfile.TemporaryDirectory() as directory, Ledger(f"sqlite:///{directory}/ledger.sqlite") as ledger:
        accounting = RunAccounting(
            ledger, "cpu-profile", "cpu-profile", config.fabric.pools, None, trainer=config.ledger.trainer
        )
        seconds = []
        for step in range(1, 7):
            accounting.begin_step(step)
            started = time.perf_counter()
            accounting.end_step(step, sum(len(r.token_ids) for r in results), {"spot-0": 100}, 0)
            accounting.step_cost_usd(step)
            seconds.append(time.perf_counter() - started)
        accounting.finish()
    # in a process of its own: its ephemeral Prefect server must not outlive the measurement
    # (two servers on one database slow the real run down)
    prefect_s = float(
        subprocess.run(
            [sys.executable, "-c", "from bench.cpu_profile import prefect_step_seconds; print(prefect_step_seconds())"],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()[-1]
    )
    ledger_s = statistics.median(seconds[1:])
    return {
        "prefect_step_s": prefect_s,
        "score_s": score_s,
        "ledger_step_s": ledger_s,
        "step_overhead_s": prefect_s + score_s + ledger_s,
    }


def prefect_step_seconds(steps: int = 6) -> float:
    """Prefect's own cost of one `rl-step` subflow: the flow's five task runs (rollout, score,
    train, publish, account) and the rollout's progress artifact, each doing no work, timed from
    inside the subflow as `step_s` is (median of `steps` after one warm-up)."""
    from prefect import flow, task
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from tasks.training import TASK_OPTIONS as options

    @task(name="rollout", **options)
    def rollout(step: int) -> dict:
        artifact = create_progress_artifact(progress=0.0, key="cpu-profile-rollout")
        update_progress_artifact(artifact, 100.0)
        return {"path": "rollout"}

    @task(name="work", **options)
    def work(step: int, *paths: str) -> dict:
        return {"path": "work"}

    @flow(name="cpu-profile-step", persist_result=False)
    def step_flow(step: int) -> float:
        started = time.perf_counter()
        first = rollout(step)
        scored = work.with_options(name="score")(step, first["path"])
        work.with_options(name="train")(step, first["path"], scored["path"])
        work.with_options(name="publish")(step)
        work.with_options(name="account")(step)
        return time.perf_counter() - started

    @flow(name="cpu-profile-steps", persist_result=False)
    def steps_flow() -> list[float]:
        return [step_flow(i) for i in range(steps + 1)]

    return statistics.median(steps_flow()[1:])


def mean_profile(before: dict, after: dict) -> dict:
    """The two calibrations around the real run, averaged: the machine's load changes within
    seconds (other users), so neither alone stands for the run between them."""
    return {k: (before[k] + after[k]) / 2 if isinstance(before[k], float) else before[k] for k in before}


def scenario_data(config, measured: dict, steps: int, cores: int) -> dict:
    """The demo configuration as a simulator scenario with the measured profile."""
    pools = {p.capacity_class: p for p in config.fabric.pools}
    spot = pools["spot"]
    poisson = spot.availability.poisson
    alive = spot.size * poisson.mean_life_s / (poisson.mean_life_s + poisson.mean_gap_s)
    trainer_threads = (measured["trainer_threads"] + 1) / 2  # training vs its engine generating
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
            "busy_processes": trainer_threads + alive,
        },
        "training": {
            "count_prompt_tokens": True,
            "while_generating": config.fabric.stream_training,
            "micro_batch_samples": config.optim.micro_batch_size,
            "step_overhead_s": measured["step_overhead_s"],
        },
        "reserved": {"gpus": 1, "engine_gpus": 1, "max_running": measured["slots"], "price_per_hour": 3.67},
        "spot": {
            "gpus": 1,
            "max_running": measured["slots"],
            "max_instances": spot.size,
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
    spot = next(p for p in config.fabric.pools if p.capacity_class == "spot")
    return spot.availability.schedule(spot.size)


def real_run(steps: int) -> list[dict]:
    """`rlboost train` of the demo configuration for `steps` steps; each step's metrics row."""
    name = f"cpu-check-{uuid.uuid4().hex[:6]}"
    overrides = [
        f"run.name={name}",
        f"run.steps={steps}",
        f"run.checkpoint_every={steps}",
        f"eval.every={steps + 1}",
    ]
    command = [sys.executable, "-m", "infra.cli.app", "train"]
    for override in overrides:
        command += ["--set", override]
    subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    steps_dir = ROOT / "runs" / name / "steps"
    return [json.loads((d / "metrics.json").read_text()) for d in sorted(steps_dir.iterdir())]
