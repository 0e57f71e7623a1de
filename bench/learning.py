"""Learning benchmark: the demo configuration end to end (pretraining the base model if it is
missing), measuring held-out sampled (T=1) exact-match accuracy before and after GRPO.

    .venv/bin/python bench/learning.py [--config FILE] [--set key=value ...]

Runs under a fresh run name so it never resumes an earlier run. The last line is JSON:
{"base_acc": .., "final_acc": .., "gain_points": .., "minutes": .., "pretrain_minutes": ..}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")

import yaml  # noqa: E402

import flows  # noqa: E402,F401  (Prefect defaults before Prefect is imported)
from infra.run.config import load_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", action="append", default=[], dest="sets")
    args = parser.parse_args()
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.sets)}
    overrides.setdefault("run.name", f"bench-learning-{int(time.time())}")
    config = load_config(args.config, overrides)

    pretrain_minutes = 0.0
    if not (config.model.path / "config.json").exists():
        from rl.pretrain import pretrain

        started = time.perf_counter()
        pretrain(config.pretrain, config.model)
        pretrain_minutes = (time.perf_counter() - started) / 60

    from flows.rl_train import run_training

    started = time.perf_counter()
    summary = run_training(args.config, overrides)
    minutes = (time.perf_counter() - started) / 60
    print(
        json.dumps(
            {
                "base_acc": round(summary["base_accuracy"], 4),
                "final_acc": round(summary["final_accuracy"], 4),
                "gain_points": round(summary["gain_points"], 2),
                "minutes": round(minutes, 2),
                "pretrain_minutes": round(pretrain_minutes, 2),
                "steps": summary["steps"],
            }
        )
    )


if __name__ == "__main__":
    main()
