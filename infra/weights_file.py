"""Interim weight path: policy versions as safetensors files in a shared directory.

The trainer `publish_weights` each version v as ``<directory>/v<v>.safetensors`` (written to a
temporary file, then renamed, so a reader never sees a partial file), then announces it: the Redis
key ``rlb:{<run_id>}:latest_version`` becomes v if v is greater (monotonic, one Lua script) and v
is PUBLISHed on ``rlb:{<run_id>}:weights``. A rollout worker behind the current step's version
`load_version`s the file and hands it to its engine.

This stands in for DESIGN section 6 (manifest, chunks, peer-to-peer pull, fsspec store) until that
lands; the function names are the seam the pull path will keep.

Tied weights (e.g. a tied ``lm_head.weight`` / ``embed_tokens.weight``) share storage, which
safetensors refuses to save; every tensor is saved as its own contiguous CPU clone, so the file
holds each name (loading with ``strict=True`` works) at the cost of the duplicate bytes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import redis
import torch
from safetensors.torch import load_file, save_file

_ADVANCE = """
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[2], ARGV[1])
return 1
"""


def latest_version_key(run_id: str) -> str:
    """Redis key holding the newest published version (a decimal string)."""
    return f"rlb:{{{run_id}}}:latest_version"


def weights_channel(run_id: str) -> str:
    """Pub/sub channel on which each newly announced version is published (message: the version)."""
    return f"rlb:{{{run_id}}}:weights"


def version_path(directory: str | Path, version: int) -> Path:
    """``<directory>/v<version>.safetensors``."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return Path(directory) / f"v{version}.safetensors"


def save_version(directory: str | Path, version: int, state_dict: Mapping[str, torch.Tensor]) -> Path:
    """Write one version's file atomically (tmp + fsync + rename); returns its path."""
    path = version_path(directory, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in state_dict.items()}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"version": str(version)})
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def publish_weights(
    client: redis.Redis,
    run_id: str,
    directory: str | Path,
    version: int,
    state_dict: Mapping[str, torch.Tensor],
) -> bool:
    """Save `state_dict` as `version`, then announce it. Returns whether `latest_version`
    advanced (False when an equal or newer version was already announced; the file is still
    written)."""
    save_version(directory, version, state_dict)
    script = client.register_script(_ADVANCE)
    return bool(script(keys=[latest_version_key(run_id), weights_channel(run_id)], args=[version]))


def latest_version(client: redis.Redis, run_id: str) -> int | None:
    """The newest announced version, or None before the first publish."""
    value = client.get(latest_version_key(run_id))
    return None if value is None else int(value)


def has_version(directory: str | Path, version: int) -> bool:
    """Whether the version's file is present (complete: it only appears by rename)."""
    return version_path(directory, version).is_file()


def load_version(directory: str | Path, version: int) -> dict[str, torch.Tensor]:
    """The state dict of `version` (CPU tensors). FileNotFoundError if it is not there."""
    path = version_path(directory, version)
    if not path.is_file():
        raise FileNotFoundError(f"no weights for version {version}: {path} does not exist")
    return load_file(str(path))
