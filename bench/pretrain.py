"""Pretraining benchmark: steps and seconds for the demo's base model to reach its threshold.

    .venv/bin/python bench/pretrain.py [--config FILE] [--seeds 1 2 3 4 5] [--threads 1 2]

Runs `rlboost pretrain`'s recipe (the config's `pretrain` and `model` sections; the demo config by
default) once per (seed, torch thread count), each in a fresh process, one after the other so the
timings do not share the CPU. Different thread counts run different float kernels, so they take
different trajectories; a recipe is only dependable if every one of them reaches the threshold.
Each model is written to a temporary directory (the project's `.rlboost/base-model` is not touched).

The last line is JSON: {"seeds": [..], "threads": [1, 2], "steps_to_threshold": [..],
"seconds_to_threshold": [..], "max_seconds": .., "failures": n, "cpu": ".."}, the lists in
(seed, threads) order, None for a run that did not reach the threshold within `max_steps`.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def cpu_model() -> str:
    """The CPU's model name (e.g. "AMD EPYC", "Intel(R) Xeon(R) ..."), as Linux reports it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def one_run(config_path: str | None, seed: int, threads: int, output: Path) -> dict:
    """Pretrain once in this process; returns its figures."""
    from infra.run.config import load_config
    from rl.pretrain import ThresholdNotReached, pretrain

    config = load_config(config_path, {"pretrain.seed": seed, "pretrain.output": str(output)})
    try:
        result = pretrain(config.pretrain, config.model, threads=threads)
    except ThresholdNotReached as error:
        return {"steps": None, "seconds": None, "error": str(error)}
    return {"steps": result.steps, "seconds": round(result.seconds, 1), "accuracy": result.accuracy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="run configuration (default: the demo config)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--one", nargs=2, type=int, metavar=("SEED", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as scratch:
            print(json.dumps(one_run(args.config, *args.one, Path(scratch) / "base-model")))
        return

    runs = []
    for seed in args.seeds:
        for threads in args.threads:
            command = [sys.executable, __file__, "--one", str(seed), str(threads)]
            if args.config:
                command += ["--config", args.config]
            finished = subprocess.run(command, capture_output=True, text=True, check=False)
            if finished.returncode != 0:
                raise SystemExit(
                    f"seed {seed}, {threads} threads: exit {finished.returncode}\n{finished.stderr[-2000:]}"
                )
            run = json.loads(finished.stdout.strip().splitlines()[-1])
            runs.append(run)
            print(
                f"seed {seed} threads {threads}: {run.get('steps')} steps, {run.get('seconds')} s"
                + (f" ({run['error']})" if "error" in run else ""),
                flush=True,
            )
    seconds = [run["seconds"] for run in runs]
    print(
        json.dumps(
            {
                "seeds": args.seeds,
                "threads": args.threads,
                "steps_to_threshold": [run["steps"] for run in runs],
                "seconds_to_threshold": seconds,
                "max_seconds": max((s for s in seconds if s is not None), default=None),
                "failures": sum(s is None for s in seconds),
                "cpu": cpu_model(),
            }
        )
    )


if __name__ == "__main__":
    main()
