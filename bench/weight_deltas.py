"""Weight deltas on real GRPO steps: what a version costs as a delta, and whether it rebuilds exactly.

    .venv/bin/python bench/weights.py --delta-only [--delta-steps 20] [--delta-new-tokens N]

For SmolLM2-135M-Instruct (`smollm2.yaml`, converted first if missing) and the demo model
(`demo.yaml`) it runs `--delta-steps` real GRPO steps in one process: a `TrainingSession` without
the fabric (the in-process HF engine generates from the config's prompts; the rewards are scored
and the real trainer steps, fp32, at the config's learning rate). Each version is published in
bf16 through a real `WeightPublisher` (embedded Redis, file:// store, `full_every` above the step
count: every version after the first a delta on the one before) and rebuilt by a `WeightPuller`.
Figures: the median of delta bytes / whole-version bytes, and the fraction of pulled versions whose
fingerprint (sha256) equals the published bf16 state's. SmolLM2 may generate fewer tokens and
prompts (`--delta-new-tokens`, `--delta-prompts`) to fit a small machine. Without a pretrained demo
model, `untrained_demo_figures` (keys `*_demo_untrained`). Method: docs/benchmarks.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rl import env_vars

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {
    "smollm2": REPO / "deployments" / "configs" / "smollm2.yaml",
    "demo": REPO / "deployments" / "configs" / "demo.yaml",
}


def _bytes(tensor):
    """A tensor's elements as rows of bytes (to compare bit patterns)."""
    import torch

    return tensor.detach().reshape(-1).contiguous().view(torch.uint8).view(-1, tensor.element_size())


def _ensure_model(model: str, config) -> None:
    if (config.model.path / "config.json").exists():
        return
    if model == "smollm2":
        from rl.model_import import import_model

        import_model("smollm2", config.model.path)
        return
    from rl.pretrain import pretrain

    pretrain(config.pretrain, config.model, threads=config.run.torch_threads)


def _measure(model: str, steps: int, scratch: Path, train_step, policy_state) -> dict:
    """Publish version 0 and the version after each of `steps` calls of `train_step(step)` in bf16,
    pull each one, and compare (module docstring)."""
    import redis
    import torch

    from infra.services.redis_embedded import EmbeddedRedis
    from infra.weights.config import WeightsConfig
    from infra.weights.manifest import fingerprint
    from infra.weights.publisher import WeightPublisher
    from infra.weights.puller import WeightPuller

    weights = WeightsConfig(full_every=steps + 1, keep_versions=1, keep_in_memory=1, serve_from_peers=False)
    fractions, changed, exact = [], [], []
    started = time.monotonic()
    with EmbeddedRedis() as redis_server:
        client = redis.Redis.from_url(redis_server.url)
        publisher = WeightPublisher(weights, client, "deltas", run_dir=scratch / model, dtype=torch.bfloat16)
        puller = WeightPuller(weights, client, "deltas", "instance", run_dir=scratch / model)
        try:
            whole_bytes, previous = None, {}
            for step in range(steps + 1):
                if step:
                    train_step(step)
                state = policy_state()
                bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v.clone() for k, v in state.items()}
                published = fingerprint(bf16)
                publisher.publish(step, state)
                publisher.flush(timeout=600)
                exact.append(fingerprint(puller.pull(step)) == published)
                manifest = publisher.store.read_manifest(step)
                if manifest.base is None:
                    whole_bytes = manifest.total_bytes
                else:
                    fractions.append(manifest.total_bytes / whole_bytes)
                    elements = sum(t.numel() for t in bf16.values())
                    rows = ((_bytes(t) != _bytes(previous[k])).any(1).sum() for k, t in bf16.items())
                    changed.append(sum(int(n) for n in rows) / elements)
                previous = bf16
                print(
                    f"  {model} v{step}: {'delta' if manifest.base is not None else 'whole'} "
                    f"{manifest.total_bytes / 1e6:.2f} MB, exact {exact[-1]}, {time.monotonic() - started:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            puller.close()
            publisher.close()
    return {
        "delta_bytes_fraction": statistics.median(fractions),
        "bytes_fraction_max": max(fractions),
        "delta_reconstruct_exact": sum(exact) / len(exact),
        "changed_fraction": statistics.median(changed),
        "steps": steps,
        "minutes": (time.monotonic() - started) / 60,
    }


def model_figures(model: str, steps: int, new_tokens: int | None, prompts: int | None, scratch: Path) -> dict:
    """`steps` real GRPO steps of `model` (generate, score, train), each version measured."""
    from infra.run.config import load_config
    from infra.run.session import TrainingSession

    overrides = {
        "run.name": f"bench-deltas-{model}-{int(time.time())}",
        "run.output_dir": str(scratch / "runs"),
        "run.steps": steps,
        "fabric.enabled": False,
        "rollout.engine": "hf",
        "ledger.url": f"sqlite:///{scratch / f'{model}-ledger.db'}",
    }
    if model == "smollm2" and new_tokens is not None:
        overrides["rollout.max_new_tokens"] = new_tokens
    if model == "smollm2" and prompts is not None:
        overrides["rollout.prompts_per_step"] = prompts
    config = load_config(CONFIGS[model], overrides)
    _ensure_model(model, config)
    session = TrainingSession(config)

    def train_step(step: int) -> None:
        rollout = session.rollout(step)
        scores = session.score(step, rollout["path"])
        session.train(step, rollout["path"], scores["path"])

    try:
        result = _measure(model, steps, scratch, train_step, session.trainer.policy_state)
    finally:
        session.close()
    samples = config.rollout.prompts_per_step * config.rollout.group_size
    return result | {"lr": config.optim.lr, "samples": samples, "max_new_tokens": config.rollout.max_new_tokens}


def untrained_demo_figures(steps: int, scratch: Path) -> dict:
    """Without a pretrained demo model (`rlboost pretrain`): a fresh model of the demo's shape,
    trained by the real trainer at the demo configuration's learning rate (no warm-up) on batches of
    the demo's size and lengths with random tokens and advantages (a fresh model earns no reward)."""
    import random

    from infra.run.config import load_config
    from rl.models import TinyLlamaShape, build_tiny_llama
    from rl.trainer import TrainBatch, Trainer

    config = load_config(CONFIGS["demo"], {"optim.warmup_steps": 0})
    shape = TinyLlamaShape(
        config.model.hidden_size, config.model.num_layers, config.model.num_heads, config.model.intermediate_size
    )
    model, tokenizer = build_tiny_llama(shape)
    trainer = Trainer(
        model, tokenizer.pad_token_id, config.grpo, config.optim, temperature=1.0, gradient_checkpointing=False
    )
    rng = random.Random(0)
    samples = config.rollout.prompts_per_step * config.rollout.group_size

    def train_step(step: int) -> None:
        prompts = [[rng.randrange(4, len(tokenizer)) for _ in range(rng.randint(12, 13))] for _ in range(samples)]
        responses = [[rng.randrange(4, len(tokenizer)) for _ in range(rng.randint(2, 6))] for _ in range(samples)]
        advantages = [rng.choice((-1.0, 1.0)) * rng.uniform(0.2, 1.5) for _ in range(samples)]
        trainer.train_step(TrainBatch(prompts, responses, [[-2.0] * len(r) for r in responses], advantages))

    result = _measure("demo-untrained", steps, scratch, train_step, trainer.policy_state)
    return result | {"lr": config.optim.lr, "samples": samples, "max_new_tokens": config.rollout.max_new_tokens}


def delta_figures(steps: int, new_tokens: int, prompts: int | None = None, models: str = "smollm2,demo") -> dict:
    """The `delta_*` keys of bench/weights.py: SmolLM2's, and the demo model's (`_demo`)."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)  # the swarm figures run with one thread per process
    os.environ.setdefault(env_vars.WEIGHTS_SECRET, os.urandom(16).hex())
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for model in models.split(","):
            if model == "demo" and not (REPO / ".rlboost" / "base-model" / "config.json").exists():
                model = "demo_untrained"
                results[model] = untrained_demo_figures(steps, Path(scratch))
            else:
                results[model] = model_figures(model, steps, new_tokens, prompts, Path(scratch))
            print(f"  {model}: {results[model]}", file=sys.stderr, flush=True)
    figures = {}
    for model, result in results.items():
        suffix = "" if model == "smollm2" else f"_{model}"
        figures[f"delta_bytes_fraction{suffix}"] = round(result["delta_bytes_fraction"], 4)
    figures["delta_reconstruct_exact"] = min(result["delta_reconstruct_exact"] for result in results.values())
    for model, result in results.items():
        for key in ("changed_fraction", "bytes_fraction_max", "lr", "steps", "samples", "max_new_tokens", "minutes"):
            value = result[key]
            figures[f"delta_{model}_{key}"] = round(value, 5) if isinstance(value, float) else value
    return figures
