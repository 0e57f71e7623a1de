"""What base model a run trains, kept in its directory for later commands: `<run>/model.json`.

Each driver of a run writes the run's `model` section there (`record_model`, under the driver
lock, atomically), its `model.path` made absolute, so `rlboost export` finds the base that the
run's checkpoints belong to (a LoRA checkpoint holds the adapters alone; a full one, the weights
without the base's configuration and tokenizer) from any working directory, without the run's
configuration file. Only the `model` section is kept: the rest of a configuration may carry
secrets (a Redis URL with its password).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from rl.config import ModelConfig

MODEL_FILE = "model.json"


class NoModelRecord(ValueError):
    """A run directory without a readable `model.json`; the message names the file and why."""


def record_model(directory: Path, model: ModelConfig) -> Path:
    """Write `model` (its path made absolute) to `directory/model.json` atomically; returns the file."""
    path = Path(directory) / MODEL_FILE
    kept = model.model_copy(update={"path": model.path.resolve()})
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as handle:
        handle.write(kept.model_dump_json(indent=1) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    return path


def read_model(directory: Path) -> ModelConfig:
    """The `model` section a driver of `directory` recorded; `NoModelRecord` if it is missing or damaged."""
    path = Path(directory) / MODEL_FILE
    try:
        return ModelConfig.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise NoModelRecord(
            f"{path} is missing: the run's driver records its base model there (runs started before "
            f"rlboost recorded it have none); {_WRITE_IT}"
        ) from None
    except (OSError, ValidationError) as error:
        first = error.errors()[0]["msg"] if isinstance(error, ValidationError) else str(error)
        raise NoModelRecord(f"{path} is damaged ({first}); {_WRITE_IT}") from None


_WRITE_IT = 'write {"path": "<the base model directory>"} there (with "gguf_file" for a GGUF base)'
