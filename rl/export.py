"""A training checkpoint as a model other tools load (`rlboost export`), by what it holds:

* `adapter`: a LoRA checkpoint as a PEFT adapter directory (its adapter files, the configuration's
  `base_model_name_or_path` the base's absolute path) with the base's tokenizer;
  `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), directory)` loads it.
* `merged`: its adapters merged into the base (`peft`'s `merge_and_unload`), and
* `full`: a full fine-tuning checkpoint's weights in the base's configuration, each as a plain
  Hugging Face directory (safetensors, configuration, tokenizer and chat template) that
  transformers and vLLM load as it is.

Weights are written in fp32, the trainer's precision (`rlboost import-model DIR --dtype bf16`
converts them); a GGUF base is read through transformers' `gguf_file=`. The output is written into
a temporary sibling directory, then renamed: whole or absent. `ExportError` says in one line what
is wrong and what to do, before anything is written. Detail: docs/commands.md ("Exporting a run").
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rl.checkpoint import damage
from rl.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from rl.trainer import WEIGHTS_FILE

Kind = Literal["adapter", "merged", "full"]


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an output that may not be written; says which and why."""


@dataclass(frozen=True)
class ExportResult:
    output: Path
    kind: Kind
    step: int
    """The checkpoint's step (= policy version)."""
    bytes: int
    """The output directory's size."""
    seconds: float


def checkpoint_step(checkpoint: Path) -> int:
    """The step of a checkpoint directory (`step_NNNNNN`)."""
    return int(checkpoint.name.removeprefix("step_"))


def is_lora_checkpoint(checkpoint: Path) -> bool:
    """Whether `checkpoint` holds LoRA adapters (else the whole policy); `ExportError` if it holds
    neither, or damaged files (`rl.checkpoint.damage`)."""
    problem = damage(checkpoint)
    if problem is None and (checkpoint / ADAPTER_WEIGHTS_FILE).exists():
        try:
            json.loads((checkpoint / ADAPTER_CONFIG_FILE).read_text())
            return True
        except (OSError, ValueError) as error:
            problem = f"{checkpoint / ADAPTER_CONFIG_FILE} is unreadable ({type(error).__name__})"
    if problem is None and not (checkpoint / WEIGHTS_FILE).exists():
        problem = f"{checkpoint} holds neither {WEIGHTS_FILE} nor {ADAPTER_WEIGHTS_FILE}"
    if problem is not None:
        raise ExportError(f"checkpoint {checkpoint} is damaged: {problem}; restore it, or export an earlier run")
    return False


def check_output(output: Path, force: bool, *keep: Path) -> None:
    """`ExportError` unless `output` may be written: absent, an empty directory, or (`force`) a
    directory to replace that holds none of `keep` (the checkpoint, the base model)."""
    if output.exists() and not output.is_dir():
        raise ExportError(f"output {output} exists and is not a directory: choose another --output")
    for path in keep:
        if path.resolve().is_relative_to(output.resolve()):
            raise ExportError(f"output {output} holds {path}, which the export reads: choose another --output")
    if output.is_dir() and any(output.iterdir()) and not force:
        raise ExportError(f"output {output} exists and is not empty: choose another --output, or --force to replace it")


def export_checkpoint(
    checkpoint: Path, base: Path, gguf_file: str | None, output: Path, *, merge: bool, force: bool = False
) -> ExportResult:
    """Write `checkpoint` (of a run on the base model at `base`, `gguf_file` inside it for a GGUF
    base) to `output`: a LoRA checkpoint as an adapter directory, or `merge`d into the base; a
    full one as a model directory (`merge` changes nothing)."""
    started = time.perf_counter()
    lora = is_lora_checkpoint(checkpoint)
    if not base.is_dir():
        raise ExportError(f"base model {base} (the run's model.path) does not exist: restore it, or record where it is")
    check_output(output, force, checkpoint, base)
    kind: Kind = ("merged" if merge else "adapter") if lora else "full"
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.export-tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir()
        if kind == "adapter":
            _write_adapter(checkpoint, base.resolve(), staging)
        else:
            _write_model(checkpoint, base, gguf_file, staging, merged=kind == "merged")
        _tokenizer(base, gguf_file).save_pretrained(str(staging))
        if output.exists():
            shutil.rmtree(output)
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in output.rglob("*") if p.is_file())
    return ExportResult(output, kind, checkpoint_step(checkpoint), size, time.perf_counter() - started)


def _write_adapter(checkpoint: Path, base: Path, directory: Path) -> None:
    """The checkpoint's adapter files, the configuration naming `base`."""
    config = json.loads((checkpoint / ADAPTER_CONFIG_FILE).read_text())
    config["base_model_name_or_path"] = str(base)
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(checkpoint / ADAPTER_WEIGHTS_FILE, directory / ADAPTER_WEIGHTS_FILE)


def _write_model(checkpoint: Path, base: Path, gguf_file: str | None, directory: Path, *, merged: bool) -> None:
    """The policy of `checkpoint` as a plain model directory: the base with the adapters merged,
    or the base's configuration with the checkpoint's weights."""
    import torch
    from safetensors.torch import load_file

    from rl.model_import import serializable
    from rl.models import load_policy

    model = serializable(load_policy(base, gguf_file, dtype=torch.float32))
    if merged:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()
        except (RuntimeError, ValueError, KeyError) as error:
            raise ExportError(
                f"the adapters of {checkpoint} do not fit the base model {base} ({str(error).splitlines()[0]}): "
                "record the run's own base in its model.json"
            ) from None
    else:
        try:
            model.load_state_dict(load_file(str(checkpoint / WEIGHTS_FILE)), strict=True)
        except RuntimeError as error:
            raise ExportError(
                f"the weights of {checkpoint} do not fit the base model {base} ({str(error).splitlines()[0]}): "
                "record the run's own base in its model.json"
            ) from None
    model.save_pretrained(str(directory), safe_serialization=True)


def _tokenizer(base: Path, gguf_file: str | None):
    """The base's tokenizer as it is saved (its chat template with it; no pad token added)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(base), **({"gguf_file": gguf_file} if gguf_file else {}))
