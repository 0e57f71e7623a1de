"""Atomic training checkpoints: policy weights, the trainer's state, RNG states, step, user state.

Layout under a root: `step_NNNNNN/model.safetensors` (the policy, loadable on its own; with
`model.lora`, `adapter_model.safetensors` and `adapter_config.json` instead: a PEFT adapter),
`step_NNNNNN/trainer.pt` (the trainer's state, RNG states, user state such as the data cursor),
`step_NNNNNN/deepspeed/` (the DeepSpeed ranks' optimizer shards) and `latest`, naming the newest
complete one. What a trainer writes is its own (`PolicyTrainer.save_state`); this module owns the
atomicity, the RNG and the user state.

`save_checkpoint` writes into a temporary directory, fsyncs, renames it into place and only then
replaces `latest` atomically: a crash never exposes a partial checkpoint (the `keep` newest stay).
`latest_checkpoint` skips a damaged one (`damage`) for the previous complete one, else raises
`CorruptCheckpoint`; one that does not fit is removed and raised as `OutOfSpace`;
`load_checkpoint` restores a trainer and the RNG. Detail: docs/internals.md §9 ("A full disk is
named", "No resume from a damaged checkpoint").
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl.disk_space import LOW_SPACE_BYTES, describe_free, free_bytes, out_of_space
from rl.lora import ADAPTER_WEIGHTS_FILE
from rl.trainer import WEIGHTS_FILE, PolicyTrainer

LATEST = "latest"
TRAINER_FILE = "trainer.pt"

log = logging.getLogger(__name__)


class CorruptCheckpoint(RuntimeError):
    """Every checkpoint that could be resumed from is damaged; the message names the file."""


class OutOfSpace(RuntimeError):
    """A checkpoint did not fit on its disk (it was removed); the message names the path, the free
    space and the previous checkpoint, which stays valid."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def capture_rng() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _fsync_tree(path: Path) -> None:
    for name in sorted(path.rglob("*")):
        if name.is_file():
            with open(name, "rb") as handle:
                os.fsync(handle.fileno())
    for directory in sorted({p.parent for p in path.rglob("*")} | {path}):
        _fsync_dir(directory)


def save_checkpoint(root: str | Path, trainer: PolicyTrainer, user_state: dict[str, Any], keep: int = 2) -> Path:
    """Write a checkpoint of `trainer` at its current step; returns its directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{trainer.step:06d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        state = trainer.save_state(tmp)
        with open(tmp / TRAINER_FILE, "wb") as handle:  # through Python's file, a short write is ENOSPC
            torch.save({"trainer": state, "rng": capture_rng(), "user": user_state}, handle)
        _fsync_tree(tmp)
    except Exception as error:
        free = free_bytes(root)
        full = out_of_space(error) or (free is not None and free < LOW_SPACE_BYTES)
        shutil.rmtree(tmp, ignore_errors=True)
        if not full:
            raise
        previous = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
        raise OutOfSpace(
            f"no space left on the device for the checkpoint of step {trainer.step} in {root}: "
            f"{describe_free(root)} once the partial checkpoint was removed. "
            + (f"The previous checkpoint, {root / previous}, stays valid: " if previous else "No checkpoint yet: ")
            + "free some space (or set run.output_dir on a larger disk) and run the same command again"
            + (" to resume from it." if previous else ".")
        ) from error
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    # Keep `final` and the newest keep-1 older ones. Directories newer than `final` were never
    # named by `latest` (left by an abandoned attempt before a resume from an earlier step): stale.
    others = sorted(p for p in root.glob("step_*") if p.name != final.name)
    older = [p for p in others if p.name < final.name]
    stale = [p for p in others if p.name > final.name] + older[: max(0, len(older) - (keep - 1))]
    for old in stale:
        shutil.rmtree(old, ignore_errors=True)
    return final


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint's files (the file and why), or None when they are whole.
    A structural check, no load: `trainer.pt` must be a complete zip archive (torch's format) and
    `model.safetensors` as long as its header says."""
    trainer = checkpoint / TRAINER_FILE
    try:
        with zipfile.ZipFile(trainer) as archive:
            archive.infolist()
    except (OSError, zipfile.BadZipFile) as exc:
        return f"{trainer} is unreadable or truncated ({exc})"
    for weights in (checkpoint / WEIGHTS_FILE, checkpoint / ADAPTER_WEIGHTS_FILE):
        if weights.exists() and (problem := _safetensors_damage(weights)):
            return problem
    return None


def _safetensors_damage(weights: Path) -> str | None:
    """What is wrong with a safetensors file's header or length (None: whole)."""
    size = weights.stat().st_size
    try:
        with weights.open("rb") as handle:
            (header_size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_size))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError) as exc:
        return f"{weights} has no readable safetensors header ({type(exc).__name__})"
    if size < 8 + header_size + end:
        return f"{weights} is truncated: {size} bytes, its header describes {8 + header_size + end}"
    return None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint that `latest` allows (None if there is none). One whose files
    are damaged is skipped for the previous one, with a warning; if every one is damaged,
    `CorruptCheckpoint` names the newest's bad file."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    # `latest` may name a directory a crash removed (while re-saving that same step): then the newest
    # complete checkpoint not newer than it counts (newer ones were never committed).
    candidates = [p for p in Path(root).glob("step_*") if p.name <= path.name and (p / TRAINER_FILE).exists()]
    problems = []
    for candidate in sorted(candidates, reverse=True):
        problem = damage(candidate)
        if problem is None:
            return candidate
        log.warning("skipping checkpoint %s: %s", candidate.name, problem)
        problems.append(problem)
    if problems:
        raise CorruptCheckpoint(
            f"no complete checkpoint to resume from: {problems[0]}; restore the file, or move "
            f"{Path(root)} away to start the run afresh"
        )
    return None


def load_checkpoint(path: str | Path, trainer: PolicyTrainer) -> dict[str, Any]:
    """Restore `trainer` and the process RNG from `path`; returns the user state saved with it."""
    path = Path(path)
    payload = torch.load(path / TRAINER_FILE, weights_only=False)
    trainer.load_state(path, payload["trainer"])
    restore_rng(payload["rng"])
    return payload["user"]
