"""LoRA adapters on a policy, through `peft`: adding them, their tensors, their files, their base.

With `model.lora` set, the trainer's policy is the base model wrapped by `add_adapters`: every
base weight frozen, one (A, B) pair per targeted linear layer trained. A policy version is then
`adapter_state(model)`: the adapter tensors alone, keyed as PEFT keys them in its files
(`base_model.model.<module>.lora_A.weight`), so a version, a checkpoint's adapters and an exported
adapter directory are the same tensors under the same names. B starts at zero, so version 0 is the
base model exactly.

`merge_adapters` computes the weights an adapter version gives the targeted layers (W + (alpha / r)
B A), for an engine that keeps the base and reloads only those layers (`rl.adapters`).
`base_digest` names the base an adapter belongs to: the weights' sha256, which a rollout instance
compares with its own base before applying a version (`infra.weights.puller`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rl.config import LoraSettings

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
"""PEFT's file of the adapter tensors (in a checkpoint and in an exported adapter directory)."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
"""PEFT's file of the adapter configuration (`peft.LoraConfig`)."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a base module's name in an adapter key."""
_LORA_A, _LORA_B = ".lora_A.weight", ".lora_B.weight"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


class LoraTargetError(ValueError):
    """`model.lora.target_modules` names a layer the model does not have (the message lists those it has)."""


class AdapterMismatch(ValueError):
    """Adapter tensors that do not fit the model they are applied to (the message names the keys)."""


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last name parts of `model`'s linear layers (`q_proj`, ..., `lm_head`)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    )


def check_targets(model: torch.nn.Module, settings: LoraSettings, where: str) -> None:
    """Raise `LoraTargetError` when a target of `settings` matches no linear layer of `model`
    (`where` names the model, e.g. its directory)."""
    layers = linear_layer_names(model)
    unknown = [name for name in settings.target_modules if name not in layers]
    if unknown:
        raise LoraTargetError(
            f"model.lora.target_modules: {', '.join(map(repr, unknown))} matches no linear layer of {where}; "
            f"its linear layers are {', '.join(layers)}: name some of those"
        )


def peft_config(settings: LoraSettings, base: str | Path | None = None):
    """The `peft.LoraConfig` of `settings` (`base`: the base model's directory, recorded in exports)."""
    from peft import LoraConfig, TaskType

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,  # pyright: ignore[reportArgumentType]  (peft annotates int; any number scales)
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type=TaskType.CAUSAL_LM,
        base_model_name_or_path=None if base is None else str(base),
    )


def add_adapters(model: torch.nn.Module, settings: LoraSettings, seed: int = 0) -> torch.nn.Module:
    """`model` wrapped with fresh adapters (a `peft.PeftModel`); only the adapters require grad.

    A is initialised from `seed` (the same on every DeepSpeed rank), B at zero."""
    from peft import get_peft_model

    check_targets(model, settings, type(model).__name__)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config(settings))  # pyright: ignore[reportArgumentType]


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` carries LoRA adapters (`add_adapters`)."""
    return hasattr(model, "peft_config")


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of `model` under PEFT's file keys (references, not copies)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


@torch.no_grad()
def load_adapter_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy `state` (PEFT's keys) into `model`'s adapters in place; `AdapterMismatch` unless the
    keys and shapes are exactly the model's."""
    current = adapter_state(model)
    missing, unexpected = sorted(set(current) - set(state)), sorted(set(state) - set(current))
    if missing or unexpected:
        raise AdapterMismatch(
            f"the adapter tensors do not fit this model's adapters: {len(missing)} missing "
            f"({', '.join(missing[:3])}), {len(unexpected)} unexpected ({', '.join(unexpected[:3])})"
        )
    for name, target in current.items():
        source = state[name]
        if source.shape != target.shape:
            raise AdapterMismatch(
                f"adapter tensor {name}: shape {tuple(source.shape)}, the model's is {tuple(target.shape)}"
            )
        target.copy_(source)


def adapted_layers(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base module name: (A, B)} of an adapter state (`model.layers.0.self_attn.q_proj`: ...)."""
    layers = {}
    for key, a in state.items():
        if key.endswith(_LORA_A):
            module = key[: -len(_LORA_A)]
            b = state.get(module + _LORA_B)
            if b is None:
                raise AdapterMismatch(f"adapter tensor {key} has no {module + _LORA_B}")
            layers[module.removeprefix(PEFT_PREFIX)] = (a, b)
    if len(layers) * 2 != len(state):
        raise AdapterMismatch(f"{len(state)} adapter tensors are not {len(layers)} (lora_A, lora_B) pairs")
    return layers


def merge_adapters(
    base: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """{`<module>.weight`: W + scale * B @ A} for every adapted module; `base` holds those W
    (computed in fp32, returned in W's dtype)."""
    merged = {}
    for module, (a, b) in adapted_layers(state).items():
        name = module + ".weight"
        weight = base.get(name)
        if weight is None:
            raise AdapterMismatch(f"the adapter targets {module}, which the base has no weight for ({name})")
        delta = (b.float() @ a.float()) * scale
        merged[name] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    return merged


def save_adapter(
    directory: Path, state: Mapping[str, torch.Tensor], settings: LoraSettings, base: str | Path | None
) -> None:
    """Write a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`) that
    `peft.PeftModel.from_pretrained(base_model, directory)` and vLLM's LoRA loader read."""
    directory.mkdir(parents=True, exist_ok=True)
    peft_config(settings, base).save_pretrained(str(directory))
    save_file(
        {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}, str(directory / ADAPTER_WEIGHTS_FILE)
    )


def read_settings(directory: Path) -> LoraSettings | None:
    """The settings of the PEFT LoRA adapter in `directory` (None: it holds no adapter)."""
    path = directory / ADAPTER_CONFIG_FILE
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return LoraSettings(
        r=config["r"],
        alpha=config["lora_alpha"],
        dropout=config.get("lora_dropout") or 0.0,
        target_modules=tuple(sorted(config["target_modules"])),
    )


def read_adapter(directory: Path) -> tuple[dict[str, torch.Tensor], LoraSettings]:
    """The tensors and settings of a PEFT LoRA adapter directory written by `save_adapter`."""
    settings = read_settings(directory)
    if settings is None:
        raise FileNotFoundError(f"{directory} holds no LoRA adapter ({ADAPTER_CONFIG_FILE} is missing)")
    return load_file(str(directory / ADAPTER_WEIGHTS_FILE)), settings


def same_settings(a: LoraSettings, b: LoraSettings) -> bool:
    """Whether adapters of `a` and `b` have the same tensors (rank and targets; alpha and dropout may differ)."""
    return a.r == b.r and sorted(a.target_modules) == sorted(b.target_modules)


_digests: dict[tuple, str] = {}


def base_digest(model_dir: str | Path) -> str:
    """sha256 over the base model's weight files (name, then bytes, in name order): what an adapter
    version is applied to. Cached per process by the files' sizes and modification times."""
    root = Path(model_dir)
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"no weight file (*.safetensors, *.bin, *.gguf) in {root}")
    key = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if key not in _digests:
        digest = hashlib.sha256()
        for path in files:
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
        _digests[key] = digest.hexdigest()
    return _digests[key]
