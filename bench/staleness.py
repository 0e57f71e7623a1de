"""Staleness benchmark: the demo configuration at `training.max_staleness` K in {0, 1, 2}, two seeds
each (`run.seed`), through the real `rl-train` flow as `rlboost train` runs it (pretraining the base
model first if it is missing), each run under a fresh run name so that none resumes another.

    .venv/bin/python bench/staleness.py [--steps 250] [--k 0 1 2] [--seeds 0 1] [--set key=value ...]

Per run it prints one JSON line; the last line is the summary, one entry per K, each the mean over
the seeds:
{"k": [0, 1, 2], "final_acc": [..], "minutes": [..], "mean_lag": [..], "is_weight_mean": [..],
 "truncated_fraction": [..]}
(`final_acc`: held-out sampled accuracy after the last step; `minutes`: the GRPO run's wall time;
the rest: means over the steps of the metrics `version_lag_mean`, `is_weight_mean`,
`is_truncated_fraction`, null where no step wrote one). What each key means in full, and the
measured results: docs/benchmarks.md; what staleness does: docs/staleness.md.
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

STEP_METRICS = {
    "mean_lag": "version_lag_mean",
    "is_weight_mean": "is_weight_mean",
    "truncated_fraction": "is_truncated_fraction",
}
"""The summary's keys and the per-step metric each one averages."""


def step_metric_means(run_dir: Path) -> dict[str, float | None]:
    """The mean over the run's steps of each per-step metric in `STEP_METRICS` (None where no
    step's metrics.json has it as a number)."""
    values: dict[str, list[float]] = {key: [] for key in STEP_METRICS}
    for path in sorted((run_dir / "steps").glob("*/metrics.json")):
        try:
            row = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for key, metric in STEP_METRICS.items():
            value = row.get(metric)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[key].append(float(value))
    return {key: statistics.fmean(found) if found else None for key, found in values.items()}


def mean_or_none(values: list[float | None], digits: int) -> float | None:
    """The mean of the values that are present, rounded (None if none is)."""
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), digits) if present else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="run configuration (default: the demo's)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's run.steps)")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2], help="training.max_staleness values")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="run.seed values")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="a config override, key=value")
    args = parser.parse_args()
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.sets)}
    if args.steps is not None:
        overrides["run.steps"] = args.steps
    config = load_config(args.config, overrides)

    if not (config.model.path / "config.json").exists():
        from rl.pretrain import pretrain

        started = time.perf_counter()
        pretrain(config.pretrain, config.model, threads=config.run.torch_threads)
        print(json.dumps({"pretrain_minutes": round((time.perf_counter() - started) / 60, 2)}), flush=True)

    from infra.services.prefect_api import current_api_url, start_guarded_ephemeral_server

    if current_api_url() is None:  # as `rlboost train`: Prefect's ephemeral server, ended with us
        start_guarded_ephemeral_server()
    from flows.rl_train import run_training

    stamp = int(time.time())
    results: dict[int, list[dict]] = {k: [] for k in args.k}
    for k in args.k:
        for seed in args.seeds:
            run = {
                **overrides,
                "run.name": f"bench-staleness-{stamp}-k{k}-s{seed}",
                "run.seed": seed,
                "training.max_staleness": k,
            }
            run_dir = load_config(args.config, run).run.directory
            started = time.perf_counter()
            summary = run_training(args.config, run)
            result = {
                "final_acc": summary["final_accuracy"],
                "minutes": (time.perf_counter() - started) / 60,
                **step_metric_means(run_dir),
            }
            results[k].append(result)
            shown = {key: round(v, 4) if isinstance(v, float) else v for key, v in result.items()}
            print(json.dumps({"k": k, "seed": seed, "base_acc": summary["base_accuracy"], **shown}), flush=True)

    line: dict[str, list] = {"k": list(args.k)}
    for key, digits in (("final_acc", 4), ("minutes", 2), *((key, 4) for key in STEP_METRICS)):
        line[key] = [mean_or_none([r[key] for r in results[k]], digits) for k in args.k]
    print(json.dumps(line))


if __name__ == "__main__":
    main()
