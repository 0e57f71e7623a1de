"""The vLLM engine's options (torch-free, so a run's configuration can hold them).

`VLLMOptions` is what `rl.vllm_engine.VLLMEngine` hands to vLLM's `EngineArgs`: dtype, how many
sequences run at once, the KV-cache size, tensor parallelism, eager mode, and whether vLLM's
engine core runs in this process or in a child process.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from rl.config import Section

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""The dtypes the engine accepts, by their short names, with vLLM's names for them."""


class VLLMOptions(Section):
    """How `VLLMEngine` runs vLLM."""

    dtype: str = "fp32"
    """Weights and activations: `fp32`, `bf16` or `fp16` (`float32`, `bfloat16`, `float16` too)."""
    max_num_seqs: int = Field(64, ge=1)
    """Sequences decoded at once; further requests wait in vLLM's queue (continuous admission)."""
    kv_cache_bytes: int = Field(1 << 30, ge=1 << 20)
    """Memory for the KV cache, in bytes (vLLM's `kv_cache_memory_bytes`)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Devices one engine shards the model over."""
    enforce_eager: bool = True
    """Eager PyTorch, no graph capture or compilation (starts in seconds; on CPU the default)."""
    multiprocessing: bool = False
    """Run vLLM's engine core in a child process (overlaps scheduling with the model on GPUs;
    starts ~30 s slower on CPU, and the caller then needs an `if __name__ == "__main__":` guard)."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value in VLLM_DTYPES.values():
            return next(short for short, long in VLLM_DTYPES.items() if long == value)
        if value not in VLLM_DTYPES:
            raise ValueError(
                f"unknown dtype {value!r}: use one of {', '.join(VLLM_DTYPES)} (or {', '.join(VLLM_DTYPES.values())})"
            )
        return value

    @property
    def vllm_dtype(self) -> str:
        """The dtype as vLLM names it."""
        return VLLM_DTYPES[self.dtype]
