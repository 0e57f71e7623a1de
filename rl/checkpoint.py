"""Atomic training checkpoints: policy weights, optimizer, scheduler, RNG states, step, data cursor.

Layout under a checkpoint root::

    step_000020/model.safetensors   policy weights (loadable on their own)
    step_000020/trainer.pt          the trainer's state + RNG states + step + user state
    step_000020/deepspeed/          the DeepSpeed trainer's sharded optimizer state (one file per rank)
    latest                          text file naming the newest complete checkpoint

What the trainer writes is its own (`Trainer.save_state`: the torch trainer's optimizer and
scheduler go in `trainer.pt`; `rl.distributed`'s ranks write `deepspeed/`); this module owns the
atomicity, the RNG and the user state (data cursor, history).

A checkpoint is written into a temporary directory, fsynced, renamed into place, and only then
named by `latest` (itself replaced atomically), so a crash at any moment leaves the previous
checkpoint intact and never exposes a partial one.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl.trainer import PolicyTrainer

LATEST = "latest"


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
    tmp.mkdir()
    state = trainer.save_state(tmp)
    torch.save({"trainer": state, "rng": capture_rng(), "user": user_state}, tmp / "trainer.pt")
    _fsync_tree(tmp)
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


def latest_checkpoint(root: str | Path) -> Path | None:
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    if (path / "trainer.pt").exists():
        return path
    # `latest` names a directory a crash removed (while re-saving that same step): fall back to
    # the newest complete checkpoint not newer than it (newer ones were never committed).
    complete = [p for p in Path(root).glob("step_*") if p.name <= path.name and (p / "trainer.pt").exists()]
    return max(complete, default=None)


def load_checkpoint(path: str | Path, trainer: PolicyTrainer) -> dict[str, Any]:
    """Restore `trainer` and the process RNG from `path`; returns the user state saved with it."""
    path = Path(path)
    payload = torch.load(path / "trainer.pt", weights_only=False)
    trainer.load_state(path, payload["trainer"])
    restore_rng(payload["rng"])
    return payload["user"]
