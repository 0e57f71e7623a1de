"""`EngineSpec`: which generation engine one process runs, on which device, in which precision.

The run's configuration (`rollout.engine`, `rollout.device`, `rollout.vllm`, `model.dtype`, and a
pool's `engine` / `device`) resolves into one `EngineSpec` per pool; it travels to a rollout
instance as a flag (`rlboost worker --engine JSON`) or a flow-run parameter, and
`rl.engine_factory.build_engine` makes the engine from it. Torch-free, so configuration and the
command line can use it without loading torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rl.config import DType, LoraSettings, Section, VLLMOptions


class EngineSpec(Section):
    """One engine: backend, device, dtype and the backend's options."""

    kind: Literal["hf", "vllm"] = "hf"
    """`hf` (`rl.engine.HFEngine`) or `vllm` (`rl.vllm_engine.VLLMEngine`)."""
    device: str = "auto"
    """Torch device; `auto`: CUDA when the machine has it, else the CPU (`rl.devices.resolve_device`)."""
    dtype: DType = "fp32"
    """Precision of the weights and activations."""
    max_batch_size: int | None = Field(default=None, ge=1)
    """Rows the HF engine decodes together (None: the caller's default, a worker's `slots`)."""
    vllm: VLLMOptions = VLLMOptions()
    """vLLM's settings (`kind: vllm`)."""
    lora: LoraSettings | None = None
    """The run's LoRA adapters (`model.lora`): the engine keeps the base weights once and each
    version it loads is adapter tensors, applied in place (`rl.adapters`)."""
