"""The base model where every rollout instance can read it: a local directory or an fsspec URL.

A local instance loads the run's base model (architecture, tokenizer, the weights of version 0)
from the training machine's directory. A cloud VM cannot, so the training run copies that
directory to a URL the VMs read (`upload_model`, by default under the run's weight store) and each
VM downloads it once into a local cache (`fetch_model`).

A copy is complete only when its index `rlboost-model.json` exists: written last, it lists every
file with its size and sha256. An upload whose index already matches is skipped; a download
verifies every file against the index and moves the directory into the cache in one rename, so a
VM killed mid-download leaves nothing that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fsspec

from rl import env_vars

INDEX = "rlboost-model.json"
"""The index of a published model directory, written after every file it lists."""
CACHE_ENV = env_vars.MODEL_CACHE


class ModelSourceError(RuntimeError):
    """A model URL with no complete copy, or a copy that does not match its index."""


def is_url(location: str) -> bool:
    """Whether `location` names an fsspec URL (`s3://...`, `gs://...`) rather than a local path."""
    return "://" in location and not location.startswith("file://")


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _index_of(directory: Path) -> dict[str, Any]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != INDEX)
    if not files:
        raise ModelSourceError(f"model directory {directory} holds no files")
    return {"files": {p.name: {"size": p.stat().st_size, "sha256": _digest(p)} for p in files}}


def upload_model(directory: str | Path, url: str, options: Mapping[str, Any] | None = None) -> str:
    """Copy the model `directory` to `url` (files first, the index last); returns `url`. Nothing
    is copied when `url` already holds the same files."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelSourceError(f"model directory {directory} does not exist (run `rlboost pretrain` first?)")
    index = _index_of(directory)
    fs, root = fsspec.core.url_to_fs(url, **dict(options or {}))
    root = root.rstrip("/")
    index_path = f"{root}/{INDEX}"
    if fs.exists(index_path) and json.loads(fs.cat_file(index_path)) == index:
        return url
    fs.makedirs(root, exist_ok=True)
    for name in index["files"]:
        fs.put_file(str(directory / name), f"{root}/{name}")
    fs.pipe_file(index_path, json.dumps(index, sort_keys=True).encode())
    return url


def fetch_model(location: str, options: Mapping[str, Any] | None = None, cache_dir: str | Path | None = None) -> Path:
    """A local directory holding the model at `location`: the path itself for a local one, else a
    verified download into the cache (reused while the index is unchanged)."""
    if not is_url(location):
        return Path(location.removeprefix("file://"))
    fs, root = fsspec.core.url_to_fs(location, **dict(options or {}))
    root = root.rstrip("/")
    try:
        raw = fs.cat_file(f"{root}/{INDEX}")
    except FileNotFoundError:
        raise ModelSourceError(
            f"no complete model at {location}: {INDEX} is missing (the training run writes it last, when it "
            "starts; check the URL and that this machine may read it)"
        ) from None
    index = json.loads(raw)
    cache = Path(cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlboost" / "models")
    target = cache / hashlib.sha256(location.encode() + raw).hexdigest()[:24]
    if (target / INDEX).exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))
    try:
        for name, expected in index["files"].items():
            local = staging / name
            fs.get_file(f"{root}/{name}", str(local))
            if local.stat().st_size != expected["size"] or _digest(local) != expected["sha256"]:
                raise ModelSourceError(
                    f"{location}/{name} does not match {INDEX} (size or sha256): upload the model again"
                )
        (staging / INDEX).write_bytes(raw)
        try:
            staging.rename(target)
        except OSError:  # another process finished the same download first
            if not (target / INDEX).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
