"""What a run runs, as the ledger records it (`runs.workload`): `run_workload(config, params)`.

A JSON-ready dict of eight sections: `model` (its path, the architecture read from its
`config.json`, the parameter count and dtype), `lora` (None for full fine-tuning; with
`model.lora` its rank, alpha, dropout and target modules, the adapters' trainable parameters and
the bytes of one adapter version), `data` (the prompts' source and their mean length in tokens),
`batch` (prompts per step, group size, response budget, sampling, bounded staleness), `pools`
(every pool's name, provider, capacity class, size, machine type, price, co-location, notice,
silent-kill fraction and availability), `trainer` (backend, world size, nodes, ZeRO stage with
DeepSpeed, gradient checkpointing, and `machine`: `ledger.trainer`), `optim` and `grpo` (those sections
whole). A baseline comparison checks that two runs agree on all of it but their spot pools
(`infra.ledger.comparison`); `rlboost cost --predict` maps it to a simulator scenario
(`infra.sim.from_run`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.run.config import RunConfig

POOL_FIELDS = (
    "name",
    "provider",
    "capacity_class",
    "size",
    "machine_type",
    "price_per_hour",
    "colocated",
    "notice_s",
    "silent_kill_fraction",
    "availability",
)
TRAINER_FIELDS = ("backend", "world_size", "nodes", "zero_stage", "gradient_checkpointing")
"""What the trainer's configuration decides of the work (not its addresses, threads and timeouts)."""


@dataclass(frozen=True)
class AdapterSize:
    """One LoRA adapter version: its tensors' elements (the trainable parameters) and bytes."""

    parameters: int
    """Elements of the adapter tensors: the trainable parameters (the base stays frozen)."""
    nbytes: int
    """Bytes of the adapter tensors in the trainer's dtype (fp32): what one published version weighs
    before chunking when the engines run fp32 (`model.dtype: bf16` halves it)."""


def adapter_size(state: Mapping[str, Any]) -> AdapterSize:
    """The size of a policy version made of adapter tensors (`PolicyTrainer.policy_state()` with LoRA)."""
    return AdapterSize(
        parameters=sum(t.numel() for t in state.values()),
        nbytes=sum(t.numel() * t.element_size() for t in state.values()),
    )


def model_architecture(path: Path) -> dict[str, Any]:
    """Layers, widths and heads from the model's Hugging Face `config.json` (empty without one)."""
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    heads = hf.get("num_attention_heads")
    hidden = hf.get("hidden_size")
    return {
        "model_type": hf.get("model_type"),
        "layers": hf.get("num_hidden_layers"),
        "hidden_size": hidden,
        "heads": heads,
        "kv_heads": hf.get("num_key_value_heads", heads),
        "head_dim": hf.get("head_dim") or (hidden // heads if hidden and heads else None),
        "vocab_size": hf.get("vocab_size"),
    }


def run_workload(
    config: RunConfig,
    params: int | None,
    mean_prompt_tokens: float | None = None,
    adapter: AdapterSize | None = None,
) -> dict[str, Any]:
    """The workload of `config` (`params`: the policy's parameter count, None if not in this
    process; `mean_prompt_tokens`: the encoded prompts' mean length, None if not measured;
    `adapter`: the size of one adapter version when the run has `model.lora`, None if not measured)."""
    model, rollout = config.model, config.rollout
    return {
        "model": {
            "path": str(model.path),
            "gguf_file": model.gguf_file,
            "dtype": model.dtype,
            "params": params,
            **model_architecture(model.path),
        },
        "lora": None
        if model.lora is None
        else {
            "r": model.lora.r,
            "alpha": model.lora.alpha,
            "dropout": model.lora.dropout,
            "target_modules": list(model.lora.target_modules),
            "trainable_parameters": adapter.parameters if adapter else None,
            "adapter_bytes": adapter.nbytes if adapter else None,
        },
        "data": {
            **config.data.model_dump(mode="json", include={"source", "family", "path"}),
            "mean_prompt_tokens": mean_prompt_tokens,
        },
        "batch": {
            "prompts_per_step": rollout.prompts_per_step,
            "group_size": rollout.group_size,
            "max_new_tokens": rollout.max_new_tokens,
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            "top_k": rollout.top_k,
            "max_staleness": config.training.max_staleness,
        },
        "pools": [pool.model_dump(mode="json", include=set(POOL_FIELDS)) for pool in config.fabric.pools]
        if config.fabric.enabled
        else [],
        "trainer": {
            **config.trainer.model_dump(mode="json", include=set(TRAINER_FIELDS)),
            **({"zero_stage": None} if config.trainer.backend != "deepspeed" else {}),  # DeepSpeed's only
            "machine": config.ledger.trainer.model_dump(mode="json") if config.ledger.trainer else None,
        },
        "optim": config.optim.model_dump(mode="json"),
        "grpo": config.grpo.model_dump(mode="json"),
    }
