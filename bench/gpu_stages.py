"""The GPU check's stages (`bench/gpu_check.py`), each run in a process of its own in the check's
environment:

    python bench/gpu_stages.py STAGE --device cuda --model-dir DIR --result FILE

writes the stage's figures (a JSON object) to FILE; an error's traceback goes to the process's
output (the stage's log). `engines`: the HF engine in bf16 against fp32, then reload, sleep and
wake; `lora`: LoRA training steps and the adapter version served by the HF engine; `deepspeed`:
a ZeRO-2 bf16 step against the torch trainer's; `fabric` (HF engines) and `vllm-fabric`: 10 GRPO
steps of `run_training` with a co-located reserved and two spot instances sharing GPU 0, one spot
instance preempted (SIGKILL to its process group) after step 2; `vllm`: CUDA vLLM against the HF
engine, then reload, sleep and wake. `--device cpu` rehearses a stage on the CPU. This module
imports only the standard library at its top; a stage imports the project where it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the trainer's ranks and the rollout workers import it from here too

from bench.gpu_check import OUT, SMOLLM2_CONFIG  # noqa: E402

PREEMPT_AFTER_STEP = 2
"""The fabric stages preempt a spot instance once this step's scores are written."""


def _requests(tokenizer, count: int, new_tokens: int):
    """`count` prompts of SmolLM2's configuration (`data`, `prompt`), 4 samples each at temperature 1."""
    import yaml

    from rl.config import DataConfig, PromptConfig, RolloutConfig
    from rl.prompt_source import PromptSource
    from rl.rollout import build_requests

    raw = yaml.safe_load(SMOLLM2_CONFIG.read_text())
    prompt = PromptConfig.model_validate(raw["prompt"] | {"chat_template": has_chat_template(tokenizer)})
    records = PromptSource(DataConfig.model_validate(raw["data"])).take(0, count)
    rollout = RolloutConfig(group_size=4, max_new_tokens=new_tokens, temperature=1.0)
    return build_requests(tokenizer, records, 1, rollout, raw["run"]["seed"], prompt)


def has_chat_template(tokenizer) -> bool:
    """SmolLM2's configuration wraps prompts in the chat template; a model without one (tiny) cannot."""
    return bool(getattr(tokenizer, "chat_template", None))


def compare(want: list[list[int]], want_lp: list[list[float]], got: list[list[int]], got_lp: list[list[float]]):
    """(fraction of token positions equal, the largest and the mean |log-prob gap| over each
    response's prefix where both drew the same tokens)."""
    positions = sum(max(len(a), len(b)) for a, b in zip(want, got)) or 1
    equal = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(want, got))
    gaps = []
    for a, b, la, lb in zip(want, got, want_lp, got_lp):
        for x, y, p, q in zip(a, b, la, lb):
            if x != y:
                break
            gaps.append(abs(p - q))
    return equal / positions, max(gaps, default=0.0), sum(gaps) / max(len(gaps), 1)


def _compared(prefix: str, want, got) -> dict[str, float]:
    """`compare` of two engines' results as figures: `<prefix>token_match` and the log-prob gaps."""
    match, gap_max, gap_mean = compare(
        [r.token_ids for r in want],
        [r.new_logprobs for r in want],
        [r.token_ids for r in got],
        [r.new_logprobs for r in got],
    )
    return {
        f"{prefix}token_match": round(match, 4),
        f"{prefix}logprob_max_abs_gap": round(gap_max, 4),
        f"{prefix}logprob_mean_abs_gap": round(gap_mean, 5),
    }


def _timed_generate(engine, requests) -> tuple[list, float]:
    """The engine's results for `requests` and the tokens it generated per second."""
    timed = time.perf_counter()
    results = engine.generate(requests)
    return results, sum(len(r.token_ids) for r in results) / (time.perf_counter() - timed)


def _engine(model_dir: Path, tokenizer, spec, **extra):
    """`build_engine` of `spec` on the model in `model_dir`, 64 rows at once."""
    from rl.engine_factory import build_engine

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return build_engine(
        spec, model_dir, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, max_batch_size=64, **extra
    )


def _free_mib(device: str) -> float | None:
    """The device's free memory in MiB (None on the CPU)."""
    import torch

    return torch.cuda.mem_get_info()[0] / 2**20 if device.startswith("cuda") else None


def reload_sleep_wake(engine, state: dict, requests, tokens: list[list[int]], device: str) -> dict[str, object]:
    """An engine's lifecycle on one policy: load perturbed weights (the tokens change) and `state`
    again (they come back), `sleep` (memory freed on a GPU) and `wake` (the tokens come back)."""
    import torch

    def tokens_now() -> list[list[int]]:
        return [r.token_ids for r in engine.generate(requests)]

    generator = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator).to(v.dtype) for k, v in state.items()}
    engine.load_weights(perturbed, 1)
    changed = 1 - compare(tokens, [], tokens_now(), [])[0]
    timed = time.perf_counter()
    engine.load_weights(state, 2)
    reload_s = time.perf_counter() - timed
    restored = compare(tokens, [], tokens_now(), [])[0]
    awake = _free_mib(device)
    timed = time.perf_counter()
    engine.sleep()
    sleep_s, asleep = time.perf_counter() - timed, _free_mib(device)
    timed = time.perf_counter()
    engine.wake()
    wake_s = time.perf_counter() - timed
    after_wake = compare(tokens, [], tokens_now(), [])[0]
    return {
        "perturbed_changed": round(changed, 4),
        "reload_s": round(reload_s, 3),
        "reload_token_match": round(restored, 4),
        "sleep_freed_mib": None if awake is None or asleep is None else round(asleep - awake, 1),
        "sleep_s": round(sleep_s, 2),
        "wake_s": round(wake_s, 2),
        "wake_token_match": round(after_wake, 4),
    }


def engines_stage(model_dir: Path, device: str) -> dict[str, object]:
    """The HF engine in bf16 against fp32 on the same 64 requests (token match, log-prob gap,
    tokens/s of each); then the bf16 engine's reload, sleep and wake."""
    from rl.engine_spec import EngineSpec
    from rl.models import load_model

    model, tokenizer = load_model(model_dir)
    requests = _requests(tokenizer, 16, 48)
    fp32 = _engine(model_dir, tokenizer, EngineSpec(kind="hf", device=device, dtype="fp32"))
    want, fp32_tps = _timed_generate(fp32, requests)
    fp32.close()
    bf16 = _engine(model_dir, tokenizer, EngineSpec(kind="hf", device=device, dtype="bf16"))
    got, bf16_tps = _timed_generate(bf16, requests)
    figures = {**_compared("", want, got), "fp32_tokens_per_s": round(fp32_tps), "bf16_tokens_per_s": round(bf16_tps)}
    figures |= reload_sleep_wake(bf16, model.state_dict(), requests, [r.token_ids for r in got], device)
    bf16.close()
    return figures


def _train_batch(vocab: int):
    """32 synthetic GRPO samples (prompts of 60-90 tokens, responses of 8-40) from a fixed seed."""
    import random

    from rl.trainer import TrainBatch

    rng = random.Random(0)
    prompts, responses, logprobs, advantages = [], [], [], []
    for _ in range(32):
        prompts.append([rng.randrange(4, vocab) for _ in range(rng.randint(60, 90))])
        length = rng.randint(8, 40)
        responses.append([rng.randrange(4, vocab) for _ in range(length)])
        logprobs.append([-2.0] * length)
        advantages.append(rng.choice((-1.0, 1.0)) * rng.uniform(0.2, 1.5))
    return TrainBatch(prompts, responses, logprobs, advantages)


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def lora_stage(model_dir: Path, device: str) -> dict[str, object]:
    """Two GRPO steps of the torch trainer with LoRA adapters (`model.lora`, bf16 autocast): the
    adapters move, the base does not; then the adapter version served by the HF engine (the base
    with adapters, in fp32) against the same weights merged into a plain model (`adapter_`) and
    against the base alone (`vs_base_`: the adapters change the log-probs)."""
    import torch

    from rl.config import GRPOConfig, LoraSettings, OptimConfig
    from rl.engine_spec import EngineSpec
    from rl.lora import merge_adapters
    from rl.models import load_model
    from rl.trainer import Trainer

    settings = LoraSettings(r=8, alpha=16.0)
    model, tokenizer = load_model(model_dir)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trainer = Trainer(
        model.to(device),
        pad,
        GRPOConfig(kl_coef=0.05),
        OptimConfig(lr=1e-3, micro_batch_size=8),
        temperature=1.0,
        gradient_checkpointing=False,
        autocast_dtype=torch.bfloat16,
        lora=settings,
    )
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    batch = _train_batch(len(tokenizer))
    timed = time.perf_counter()
    losses = [trainer.train_step(batch)["loss"] for _ in range(2)]
    _synchronize(device)
    step_s = (time.perf_counter() - timed) / 2
    moved = max(float((p.detach() - frozen[n]).abs().max()) for n, p in trainer.model.named_parameters() if n in frozen)
    adapters = {k: v.detach().float().cpu() for k, v in trainer.policy_state().items()}
    del trainer
    requests = _requests(tokenizer, 16, 48)
    served = _engine(model_dir, tokenizer, EngineSpec(kind="hf", device=device, dtype="fp32", lora=settings))
    served.load_weights(adapters, 1)
    got = served.generate(requests)
    served.close()
    merged = _engine(model_dir, tokenizer, EngineSpec(kind="hf", device=device, dtype="fp32"))
    before = merged.generate(requests)  # the base alone
    merged.load_weights(base | merge_adapters(base, adapters, settings.scale), 1)
    want = merged.generate(requests)
    merged.close()
    return {
        "trainable_fraction": round(trainable / sum(v.numel() for v in base.values()), 5),
        "adapter_mib": round(sum(v.numel() * 2 for v in adapters.values()) / 2**20, 3),
        "losses": [round(loss, 5) for loss in losses],
        "lora_step_s": round(step_s, 3),
        "adapter_norm": round(sum(float(v.norm()) ** 2 for v in adapters.values()) ** 0.5, 4),
        "base_max_change": moved,
        **_compared("adapter_", want, got),
        **_compared("vs_base_", before, got),
    }


def update_gap(before: dict, got: dict, want: dict) -> float:
    """How far one step's update (`got` - `before`) is from another's (`want` - `before`): the L2
    norm of their difference over the L2 norm of `want`'s, every tensor together."""
    apart = sum(float(((got[k] - want[k]).double() ** 2).sum()) for k in want)
    size = sum(float(((want[k] - before[k]).double() ** 2).sum()) for k in want)
    return (apart / size) ** 0.5 if size else float("inf")


def deepspeed_stage(model_dir: Path, device: str) -> dict[str, object]:
    """One GRPO step of the DeepSpeed trainer (ZeRO-2, `autocast: bf16`, one rank per GPU, up to 2)
    against the torch trainer's on the same batch, in bf16 autocast and in fp32: how far apart the
    updates are (`update_gap`), the losses, step seconds."""
    import torch

    from rl.config import GRPOConfig, OptimConfig, TrainerConfig
    from rl.distributed.protocol import TrainSpec
    from rl.distributed.trainer import DistributedTrainer
    from rl.models import load_model
    from rl.trainer import Trainer

    grpo, optim = GRPOConfig(kl_coef=0.05), OptimConfig(lr=1e-5, micro_batch_size=8)
    model, tokenizer = load_model(model_dir)
    before = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    batch = _train_batch(len(tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch_side: dict[str, tuple[dict, dict, float]] = {}
    for name, autocast in (("bf16", torch.bfloat16), ("fp32", None)):
        reference = Trainer(
            load_model(model_dir)[0].to(device),
            pad,
            grpo,
            optim,
            temperature=1.0,
            gradient_checkpointing=False,
            autocast_dtype=autocast,
        )
        timed = time.perf_counter()
        metrics = reference.train_step(batch)
        _synchronize(device)
        state = {k: v.detach().float().cpu() for k, v in reference.policy_state().items()}
        torch_side[name] = (metrics, state, time.perf_counter() - timed)
        del reference
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    ranks = min(2, torch.cuda.device_count()) if device.startswith("cuda") else 1
    spec = TrainSpec(
        model_path=model_dir,
        device=device,
        autocast="bf16",
        pad_token_id=pad,
        temperature=1.0,
        grpo=grpo,
        optim=optim,
        trainer=TrainerConfig(backend="deepspeed", world_size=ranks, zero_stage=2),
    )
    timed = time.perf_counter()
    distributed = DistributedTrainer(spec, OUT / "deepspeed-ranks.log")
    start_s = time.perf_counter() - timed
    try:
        timed = time.perf_counter()
        got = distributed.train_step(batch)
        deepspeed_s = time.perf_counter() - timed
        got_state = {k: v.float().cpu() for k, v in distributed.policy_state().items()}
    finally:
        distributed.close()
    want, want_state, torch_s = torch_side["bf16"]
    return {
        "ranks": ranks,
        "update_gap": round(update_gap(before, got_state, want_state), 4),
        "update_gap_vs_fp32": round(update_gap(before, got_state, torch_side["fp32"][1]), 4),
        "bf16_vs_fp32_gap": round(update_gap(before, want_state, torch_side["fp32"][1]), 4),
        "loss_torch": round(want["loss"], 5),
        "loss_deepspeed": round(got["loss"], 5),
        "grad_norm_torch": round(want["grad_norm"], 4),
        "grad_norm_deepspeed": round(got["grad_norm"], 4),
        "torch_step_s": round(torch_s, 2),
        "deepspeed_step_s": round(deepspeed_s, 2),
        "deepspeed_start_s": round(start_s, 1),
    }


def vllm_stage(model_dir: Path, device: str) -> dict[str, object]:
    """CUDA vLLM against the HF engine (both bf16; tokens/s of each), then vLLM's in-place reload
    and sleep/wake."""
    import torch

    from rl.config import VLLMOptions
    from rl.engine_spec import EngineSpec
    from rl.models import load_model

    model, tokenizer = load_model(model_dir)
    requests = _requests(tokenizer, 16, 48)
    hf = _engine(model_dir, tokenizer, EngineSpec(kind="hf", device=device, dtype="bf16"))
    want, hf_tps = _timed_generate(hf, requests)
    hf.close()
    options = VLLMOptions(max_num_seqs=64, kv_cache_bytes=1 << 30, max_model_len=1024, gpu_memory_utilization=0.5)
    spec = EngineSpec(kind="vllm", device=device, dtype="bf16", vllm=options)
    vllm = _engine(model_dir, tokenizer, spec, sleep_mode=True)
    vllm.generate(requests[:4])  # warm-up
    got, vllm_tps = _timed_generate(vllm, requests)
    figures = {**_compared("", want, got), "hf_tokens_per_s": round(hf_tps), "vllm_tokens_per_s": round(vllm_tps)}
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    figures |= reload_sleep_wake(vllm, state, requests, [r.token_ids for r in got], device)
    vllm.close()
    return figures


def fabric_overrides(model_dir: Path, name: str, engine: str, device: str, steps: int = 10) -> dict[str, object]:
    """The fabric stages' run: SmolLM2's configuration in bf16 on `device`, rollout on `engine`, a
    co-located reserved instance and two spot instances (on a GPU: GPU 0, a third of it each)."""
    machine: dict[str, object] = {"machine_type": "a2-highgpu-1g"}
    if device.startswith("cuda"):
        machine["gpus_per_instance"] = round(1 / 3, 4)
    overrides: dict[str, object] = {
        "run.name": name,
        "run.output_dir": str(OUT / "runs"),
        "run.steps": steps,
        "run.checkpoint_every": steps,
        "model.path": str(model_dir),
        "model.device": device,
        "model.dtype": "bf16",
        "rollout.engine": engine,
        "rollout.device": device,
        "rollout.prompts_per_step": 8,
        "rollout.group_size": 8,
        "rollout.max_new_tokens": 64,
        "eval.every": steps,
        "eval.size": 32,
        "fabric.enabled": True,
        "fabric.pools": [
            {"name": "reserved", "capacity_class": "reserved", "size": 1, "colocated": True, "price_per_hour": 3.67}
            | machine,
            {"name": "spot", "capacity_class": "spot", "size": 2, "price_per_hour": 1.10} | machine,
        ],
        "fabric.worker": {"slots": 64},
    }
    if engine == "vllm":
        overrides["rollout.vllm"] = {
            "max_num_seqs": 64,
            "kv_cache_bytes": 1 << 30,
            "max_model_len": 512,
            "gpu_memory_utilization": 0.6,
            "multiprocessing": True,  # the co-located instance's engine beside the in-process one
        }
    return overrides


def _processes() -> dict[int, tuple[int, list[str]]]:
    """pid -> (parent pid, command line words) of every process this user can read (from /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            words = (stat.parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile
            continue
        found[int(stat.parent.name)] = (int(fields[1]), words)
    return found


def spot_workers(ancestor: int, pool: str = "spot") -> dict[str, int]:
    """instance id -> pid of the rollout workers of `pool` that descend from process `ancestor`."""
    table = _processes()

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = table[pid][0] if pid in table else 0
            if pid == ancestor:
                return True
        return False

    found = {}
    for pid, (_, words) in table.items():
        if "infra.rollout.worker" in words and words.count("--pool") and descends(pid):
            if words[words.index("--pool") + 1] == pool:
                found[words[words.index("--instance-id") + 1]] = pid
    return found


def preempt_one(marker: Path, done: threading.Event, record: dict[str, object]) -> None:
    """Once `marker` exists (a step's scores), preempt the first spot instance without notice, as a
    spot VM's reclaim does: SIGKILL to its process group (a local instance is a group of its own).
    Writes what it did into `record`; gives up when `done` is set first."""
    while not done.wait(0.2):
        workers = spot_workers(os.getpid()) if marker.exists() else {}
        if workers:
            instance, pid = min(workers.items())
            os.killpg(pid, signal.SIGKILL)
            record.update(instance=instance, signal="SIGKILL", after_step=PREEMPT_AFTER_STEP)
            return


def fabric_stage(model_dir: Path, device: str, engine: str = "hf") -> dict[str, object]:
    """10 GRPO steps of `flows.rl_train.run_training` on the fabric with `engine` instances, one spot
    instance preempted after step 2: reward before and after (the first and last three steps' mean
    training reward), tokens generated per second, instances replaced, samples migrated."""
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("DO_NOT_TRACK", "1")  # the GPU machine reaches nothing outside: no telemetry
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.rl_train import run_training
    from infra.run.config import load_config
    from rl.models import load_tokenizer

    overrides = fabric_overrides(model_dir, f"gpu-check-{engine}-{int(time.time())}", engine, device)
    if not has_chat_template(load_tokenizer(model_dir)):
        overrides["prompt.chat_template"] = False
    run_dir = load_config(SMOLLM2_CONFIG, overrides).run.directory
    preempted: dict[str, object] = {}
    done = threading.Event()
    marker = run_dir / "steps" / f"{PREEMPT_AFTER_STEP:06d}" / "scores.json"
    watcher = threading.Thread(target=preempt_one, args=(marker, done, preempted), daemon=True)
    watcher.start()
    timed = time.perf_counter()
    try:
        summary = run_training(SMOLLM2_CONFIG, overrides)
    finally:
        done.set()
        watcher.join()
    seconds = time.perf_counter() - timed
    steps = int(summary["steps"])

    def step_file(step: int, name: str) -> dict:
        return json.loads((run_dir / "steps" / f"{step:06d}" / name).read_text())

    def reward(step: int) -> float:
        rewards = step_file(step, "scores.json")["rewards"]
        return sum(rewards) / len(rewards)

    rows = [step_file(step, "metrics.json") for step in range(1, steps + 1)]
    return {
        "steps": steps,
        "reward_first3": round(sum(map(reward, (1, 2, 3))) / 3, 4),
        "reward_last3": round(sum(map(reward, (steps - 2, steps - 1, steps))) / 3, 4),
        "tokens_per_s": round(summary["tokens_generated"] / seconds),
        "held_out_accuracy": [round(summary["base_accuracy"], 3), round(summary["final_accuracy"], 3)],
        "preempted": preempted or None,
        "replaced": sum(row["replaced"] for row in rows),
        "migrations": sum(row["migrations"] for row in rows),
    }


STAGES: dict[str, Callable[[Path, str], dict[str, object]]] = {
    "engines": engines_stage,
    "lora": lora_stage,
    "deepspeed": deepspeed_stage,
    "fabric": fabric_stage,
    "vllm": vllm_stage,
    "vllm-fabric": lambda model_dir, device: fabric_stage(model_dir, device, "vllm"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("stage", choices=tuple(STAGES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        figures = STAGES[args.stage](args.model_dir, args.device)
    except Exception:
        traceback.print_exc()
        return 1
    args.result.write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
