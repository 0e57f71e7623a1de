"""Atomic training checkpoints: policy weights, optimizer, scheduler, RNG states, step, data cursor.

Layout under a checkpoint root::

    step_000020/model.safetensors   policy weights (loadable on their own)
    step_000020/trainer.pt          optimizer + scheduler + RNG states + step + user state
    latest                          text file naming the newest complete checkpoint

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
from safetensors.torch import load_file, save_file

from rl.trainer import Trainer

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


def save_checkpoint(root: str | Path, trainer: Trainer, user_state: dict[str, Any], keep: int = 2) -> Path:
    """Write a checkpoint of `trainer` at its current step; returns its directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{trainer.step:06d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = trainer.state_dict()
    weights = {k: v.detach().contiguous().clone() for k, v in state.pop("model").items()}
    save_file(weights, str(tmp / "model.safetensors"))
    torch.save({"trainer": state, "rng": capture_rng(), "user": user_state}, tmp / "trainer.pt")
    for name in ("model.safetensors", "trainer.pt"):
        with open(tmp / name, "rb") as handle:
            os.fsync(handle.fileno())
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "trainer.pt").exists() else None


def load_checkpoint(path: str | Path, trainer: Trainer) -> dict[str, Any]:
    """Restore `trainer` and the process RNG from `path`; returns the user state saved with it."""
    path = Path(path)
    payload = torch.load(path / "trainer.pt", weights_only=False)
    state = payload["trainer"]
    state["model"] = load_file(str(path / "model.safetensors"))
    trainer.load_state_dict(state)
    restore_rng(payload["rng"])
    return payload["user"]
