"""Co-located vs separate reserved rollout: demo-config RL steps with the reserved instance inside
the training process (`colocated: true`) against the same steps with it as a worker process.

    .venv/bin/python bench/colocated.py [--steps 16] [--warmup 1] [--set key=value ...]

Both runs share the demo configuration, spot pool and seeds, each in its own session of this
process, their steps timed interleaved with the order alternating every step, so load that comes
and goes on a shared machine falls on both alike. Needs the pretrained base model (`rlboost
pretrain`). Prints the per-step times and ends with one JSON line:
`{"colocated_step_s": .., "separate_step_s": .., "ratio": .., "reserved_busy_fraction": .., "t_local_s": ..}`
(median step seconds; ratio = colocated / separate; `reserved_busy_fraction`: the co-located
engine's time in engine steps, `WorkerStats.generating_s`, over the measured steps' wall time;
`t_local_s`: the co-located run's `T_local` after its last step). Method and results:
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infra.run.config import DEFAULT_CONFIG, RunConfig, load_config  # noqa: E402
from infra.run.session import TrainingSession  # noqa: E402
from infra.run.step_record import StepRecord  # noqa: E402

VARIANTS = ("colocated", "separate")
READY_TIMEOUT_S = 120.0


def variant_config(variant: str, steps: int, output_dir: str, overrides: dict) -> RunConfig:
    """The demo configuration with the reserved pool co-located or not (nothing else differs)."""
    demo = load_config(DEFAULT_CONFIG, overrides)
    pools = [
        pool.model_copy(update={"colocated": variant == "colocated"}) if pool.capacity_class == "reserved" else pool
        for pool in demo.fabric.pools
    ]
    return load_config(
        DEFAULT_CONFIG,
        {
            **overrides,
            "run.name": f"bench-colocated-{variant}",
            "run.steps": steps,
            "run.output_dir": output_dir,
            "run.checkpoint_every": 10**6,
            "eval.every": 10**6,
            "ledger.url": f"sqlite:///{output_dir}/ledger.sqlite",
            "fabric.pools": [pool.model_dump(exclude_defaults=True) for pool in pools],
        },
    )


def wait_until_ready(session: TrainingSession) -> None:
    fabric = session.fabric
    assert fabric is not None
    want = sum(pool.size for pool in fabric.config.pools)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while len(fabric.registry.alive()) < want:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(fabric.registry.alive())} of {want} instances registered")
        time.sleep(0.1)


def one_step(session: TrainingSession, step: int) -> dict:
    """The work of `rl_step(evaluate=False, checkpoint=False)`: rollout, score, train, publish, account, record."""
    rollout = session.rollout(step)
    scores = session.score(step, rollout["path"])
    metrics = session.train(step, rollout["path"], scores["path"])
    session.publish(step)
    session.account(step, int(metrics["response_tokens"]))
    session.record(StepRecord(step=step, reward=scores["reward"], tokens=rollout["tokens"]))
    return {
        "reward": scores["reward"],
        "rollout_s": rollout["seconds"],
        "train_s": metrics["seconds"],
        "t_local_s": rollout["t_local_s"],
        "preemptions": rollout["preemptions"],
    }


def compare(configs: dict[str, RunConfig], warmup: int) -> dict[str, dict]:
    """Open both sessions, then run their steps interleaved (the order alternates every step), so
    load that comes and goes on a shared machine falls on both alike; per variant the median step
    time, and the co-located engine's generating time over the measured steps."""
    sessions: dict[str, TrainingSession] = {}
    try:
        for variant, config in configs.items():
            sessions[variant] = TrainingSession(config)
        for session in sessions.values():
            wait_until_ready(session)
        stats = sessions["colocated"].fabric.colocated[0].worker.stats
        seconds: dict[str, list[float]] = {variant: [] for variant in configs}
        generating = 0.0
        steps = configs["colocated"].run.steps
        for step in range(1, steps + 1):
            order = VARIANTS if step % 2 else VARIANTS[::-1]
            for variant in order:
                before = stats.generating_s
                started = time.perf_counter()
                row = one_step(sessions[variant], step)
                elapsed = time.perf_counter() - started
                if step > warmup:
                    seconds[variant].append(elapsed)
                    generating += stats.generating_s - before if variant == "colocated" else 0.0
                t_local = "-" if row["t_local_s"] is None else f"{row['t_local_s']:.2f}"
                print(
                    f"  step {step} {variant:>9}: {elapsed:.3f} s (rollout {row['rollout_s']:.3f} s, "
                    f"train {row['train_s']:.3f} s)  reward {row['reward']:.3f}  released at {t_local} s  "
                    f"preemptions so far {row['preemptions']}",
                    flush=True,
                )
        paired = [co / sep for co, sep in zip(seconds["colocated"], seconds["separate"])]
        print(f"median of the per-step ratios (colocated / separate, same step): {statistics.median(paired):.3f}")
        return {
            variant: {
                "step_s": statistics.median(seconds[variant]),
                "busy_fraction": generating / sum(seconds["colocated"]),
                "t_local_s": sessions[variant].fabric.controller.offload.to_dict()["t_local"],
            }
            for variant in configs
        }
    finally:
        for session in sessions.values():
            session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="RL steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="first steps not counted")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="key=value override of demo.yaml")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.sets)}
    with tempfile.TemporaryDirectory(prefix="rlboost-bench-colocated-") as output_dir:
        configs = {variant: variant_config(variant, args.steps, output_dir, overrides) for variant in VARIANTS}
        if not (configs["colocated"].model.path / "config.json").exists():
            raise SystemExit(
                f"no base model at {configs['colocated'].model.path}: run `.venv/bin/rlboost pretrain` first"
            )
        results = compare(configs, args.warmup)
    colocated, separate = results["colocated"], results["separate"]
    print(
        f"median step over {args.steps - args.warmup} steps: colocated {colocated['step_s']:.3f} s, "
        f"separate {separate['step_s']:.3f} s; T_local colocated {colocated['t_local_s']:.2f} s, "
        f"separate {separate['t_local_s']:.2f} s",
        flush=True,
    )
    print(
        json.dumps(
            {
                "colocated_step_s": round(colocated["step_s"], 4),
                "separate_step_s": round(separate["step_s"], 4),
                "ratio": round(colocated["step_s"] / separate["step_s"], 4),
                "reserved_busy_fraction": round(colocated["busy_fraction"], 4),
                "t_local_s": round(colocated["t_local_s"], 4),
            }
        )
    )


if __name__ == "__main__":
    main()
