"""Prefect's overhead per RL step: the `rl-step` subflow with its tasks and artifact against the same
step run by calling the `TrainingSession` methods directly.

    .venv/bin/python bench/orchestration.py [--steps 12 --warmup 2]   # needs `rlboost pretrain`

The variants run interleaved in one process on the demo configuration with in-process rollout
(so only Prefect differs), computing the same steps; results are medians of the per-step
differences. The `rl-step` runs go as `rl-train` runs them (`flows.step_settings`: with a
PREFECT_API_URL they send heartbeats from a thread that ends with the step); a third variant runs
them with Prefect's own heartbeat thread (every 30 s, as the work pools set it), which the flow
engine joins when a run ends, to show what that wait costs a step. Prints the per-step times and ends
with one JSON line: `{"overhead_s_per_step": .., "fraction": .., "overhead_s_per_step_with_engine_heartbeats": ..,
"direct_step_s": .., "prefect_step_s": .., "steps_measured": ..}` (fraction = overhead / direct
step time). Method: docs/benchmarks.md; figures: docs/prefect.md ("Prefect's cost per step").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")  # the per-step lines below are the output

from prefect import flow  # noqa: E402
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings  # noqa: E402

import flows  # noqa: E402,F401  (quiet, embedded-friendly Prefect defaults before Prefect is imported)
from flows.rl_train import rl_step  # noqa: E402
from flows.step_settings import step_settings  # noqa: E402
from infra.run.config import DEFAULT_CONFIG, load_config  # noqa: E402
from infra.run.session import TrainingSession, close_session, get_session, open_session  # noqa: E402
from infra.run.step_record import StepRecord  # noqa: E402

VARIANTS = ("prefect", "prefect_engine_heartbeats", "direct")
ENGINE_HEARTBEAT_S = 30
"""The heartbeat frequency the work pools' base job template sets (deployments/work-pools)."""


def direct_step(session: TrainingSession, step: int) -> None:
    """The work of `rl_step(evaluate=False, checkpoint=False)` without Prefect: the same session
    calls in the same order (rollout, score, train, publish, account, record)."""
    rollout = session.rollout(step)
    scores = session.score(step, rollout["path"])
    metrics = session.train(step, rollout["path"], scores["path"])
    session.publish(step)
    cost = session.account(step, int(metrics["response_tokens"]))
    session.record(
        StepRecord(
            step=step,
            reward=scores["reward"],
            tokens=rollout["tokens"],
            train_s=metrics["seconds"],
            cost_usd=cost["cost_usd"],
        )
    )


def run_variant(variant: str, key: str, step: int) -> None:
    if variant == "direct":
        direct_step(get_session(key), step)
    elif variant == "prefect_engine_heartbeats":
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: ENGINE_HEARTBEAT_S}):
            rl_step(key, step, evaluate=False, checkpoint=False)
    else:
        with step_settings():
            rl_step(key, step, evaluate=False, checkpoint=False)


@flow(name="bench-orchestration", persist_result=False)
def compare(steps: int, output_dir: str) -> list[dict]:
    overrides = {
        "fabric.enabled": False,
        "run.steps": steps,
        "run.checkpoint_every": 10**6,
        "run.output_dir": output_dir,
    }
    configs = {
        variant: load_config(DEFAULT_CONFIG, {**overrides, "run.name": variant.replace("_", "-")})
        for variant in VARIANTS
    }
    if not (configs["direct"].model.path / "config.json").exists():
        raise SystemExit(f"no base model at {configs['direct'].model.path}: run `.venv/bin/rlboost pretrain` first")
    keys = {variant: f"bench-{variant}-{uuid.uuid4().hex[:6]}" for variant in VARIANTS}
    for variant in VARIANTS:
        open_session(keys[variant], configs[variant])
    rows = []
    try:
        for step in range(1, steps + 1):
            timings = {}
            for variant in VARIANTS[step % 3 :] + VARIANTS[: step % 3]:
                started = time.perf_counter()
                run_variant(variant, keys[variant], step)
                timings[variant] = time.perf_counter() - started
            rows.append({"step": step, **timings})
            print(f"step {step}: " + "  ".join(f"{v} {timings[v]:.3f} s" for v in VARIANTS), flush=True)
    finally:
        for key in keys.values():
            close_session(key)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="RL steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="first steps not counted")
    args = parser.parse_args()
    if args.steps < args.warmup + 3:
        parser.error("--steps must exceed --warmup by at least 3")
    with tempfile.TemporaryDirectory(prefix="rlboost-bench-") as output_dir:
        rows = compare(args.steps, output_dir)
    measured = rows[args.warmup :]
    direct = statistics.median(r["direct"] for r in measured)
    prefect = statistics.median(r["prefect"] for r in measured)
    overhead = statistics.median(r["prefect"] - r["direct"] for r in measured)
    engine_heartbeats = statistics.median(r["prefect_engine_heartbeats"] - r["direct"] for r in measured)
    print(
        f"median over {len(measured)} steps: direct {direct:.3f} s, with Prefect {prefect:.3f} s, "
        f"overhead {overhead:.3f} s per step ({100 * overhead / direct:.0f}% of a step; target <= 1.5 s); "
        f"{engine_heartbeats:.3f} s with Prefect's own heartbeat thread in each step"
    )
    print(
        json.dumps(
            {
                "overhead_s_per_step": round(overhead, 4),
                "fraction": round(overhead / direct, 4),
                "overhead_s_per_step_with_engine_heartbeats": round(engine_heartbeats, 4),
                "direct_step_s": round(direct, 4),
                "prefect_step_s": round(prefect, 4),
                "steps_measured": len(measured),
            }
        )
    )


if __name__ == "__main__":
    main()
