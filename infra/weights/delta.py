"""A version as a sparse delta against the previous one: encode, and reconstruct bit for bit.

`encode_delta(base, state, version, base_version, chunk_bytes)` compares each tensor's bit patterns
(never float equality: NaN, -0.0) with the base's and packs, per tensor that changed, the changed
flat positions and their new bit patterns (in the tensor's own dtype: the engines') into an
ordinary payload (`infra.weights.manifest.encode`: manifest + sha256-checked safetensors chunks),
whose manifest names its `base` and the `full_sha256` (`fingerprint`) of the version it rebuilds.
Positions travel as gaps or as a bitmap, whichever is smaller; the new bits as their wrapping
integer difference from the old (mostly a rounding step or two); all zlib-compressed by bytes. `apply_delta(base, payload)` rebuilds the full state dict (unchanged
tensors are the base's own, read only) and `reconstruct` checks it against `full_sha256`; a
mismatch is a `DeltaError`, never weights. `delta_layout_matches`: whether a delta can describe
`state` at all (same names, dtypes and shapes as the base). Detail: docs/internals.md §6.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np
import torch

from infra.weights.manifest import EncodedVersion, ManifestError, encode, fingerprint

GAPS, MASK, VALUES = "#gaps", "#mask", "#steps"
"""Suffixes of a changed tensor's entries in a delta payload (after the tensor's name)."""
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ZLIB_LEVEL = 6


class DeltaError(ManifestError):
    """A delta does not apply to the base it is given, or does not rebuild its version."""


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """A flat tensor's elements as integers of the same width (bit patterns), one row each."""
    size = flat.element_size()
    if size in _BITS:
        return flat.view(_BITS[size]) if flat.dtype != _BITS[size] else flat
    return flat.view(torch.uint8).reshape(-1, size)  # e.g. complex128: a row of bytes per element


def delta_layout_matches(base: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> bool:
    """Whether `state` has the base's tensors: the same names in the same order, dtypes and shapes."""
    return list(base) == list(state) and all(
        base[name].dtype == tensor.dtype and base[name].shape == tensor.shape for name, tensor in state.items()
    )


def _pack(rows: np.ndarray) -> bytes:
    """Fixed-width values as a (count, width) byte matrix, compressed: one byte of width, then zlib
    of the byte planes (all first bytes, then all second bytes, ...): far smaller than interleaved."""
    return bytes([rows.shape[1]]) + zlib.compress(np.ascontiguousarray(rows.T).tobytes(), _ZLIB_LEVEL)


def _unpack(data: bytes) -> np.ndarray:
    """`_pack`'s (count, width) byte matrix."""
    planes = np.frombuffer(zlib.decompress(data[1:]), dtype=np.uint8).reshape(data[0], -1)
    return planes.T.copy(order="C")


def _encode_positions(positions: np.ndarray, numel: int) -> tuple[str, bytes]:
    """The smaller of the compressed gaps and the compressed bitmap of sorted `positions`."""
    gaps = np.diff(positions, prepend=-1)
    as_gaps = _pack(
        gaps.astype("<u4" if numel <= np.iinfo(np.uint32).max else "<u8").view(np.uint8).reshape(len(gaps), -1)
    )
    mask = np.zeros(numel, dtype=bool)
    mask[positions] = True
    as_mask = zlib.compress(np.packbits(mask).tobytes(), _ZLIB_LEVEL)
    return (GAPS, as_gaps) if len(as_gaps) <= len(as_mask) else (MASK, as_mask)


def _decode_positions(kind: str, data: bytes, numel: int, name: str) -> np.ndarray:
    try:
        if kind == MASK:
            bits = np.unpackbits(np.frombuffer(zlib.decompress(data), dtype=np.uint8), count=numel)
            return np.flatnonzero(bits)
        rows = _unpack(data)
        if rows.shape[1] not in (4, 8):
            raise ValueError(f"gaps of {rows.shape[1]} bytes")
        return np.cumsum(rows.view(f"<u{rows.shape[1]}").reshape(-1).astype(np.int64)) - 1
    except (zlib.error, ValueError, IndexError, TypeError) as exc:
        raise DeltaError(f"{name}: changed positions do not decode: {exc}") from None


def _flat_bits(tensor: torch.Tensor) -> torch.Tensor:
    return _bits(tensor.detach().cpu().contiguous().reshape(-1))


def _blob(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def diff(base: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The delta payload's tensors: per changed tensor of `state`, its positions and new bits."""
    payload: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        old, new = _flat_bits(base[name]), _flat_bits(tensor)
        differ = old != new
        positions = (differ.any(dim=1) if differ.dim() == 2 else differ).nonzero().reshape(-1)
        if positions.numel() == 0:
            continue
        kind, data = _encode_positions(positions.numpy(), len(new))
        steps = (new[positions] - old[positions]).contiguous()  # integer arithmetic wraps: exact both ways
        payload[name + kind] = _blob(data)
        payload[name + VALUES] = _blob(_pack(steps.reshape(len(positions), -1).view(torch.uint8).numpy()))
    return payload


def encode_delta(
    base: Mapping[str, torch.Tensor],
    state: Mapping[str, torch.Tensor],
    version: int,
    base_version: int,
    chunk_bytes: int,
    parent: int | None = None,
    created: float | None = None,
    adapter_base: str | None = None,
) -> EncodedVersion:
    """`state` as a delta payload against `base` (version `base_version`); the layouts must match
    (`adapter_base`: the versions are LoRA adapters of that base model)."""
    if not delta_layout_matches(base, state):
        raise ValueError(f"version {version}: a delta needs the base's tensor names, dtypes and shapes")
    return encode(
        diff(base, state),
        version,
        chunk_bytes,
        parent=parent,
        created=created,
        base=base_version,
        full_sha256=fingerprint(state),
        adapter_base=adapter_base,
    )


def apply_delta(base: Mapping[str, torch.Tensor], payload: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full state dict: `base` with the payload's changes (each changed tensor a new copy)."""
    changes: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in payload.items():
        name, sep, suffix = key.rpartition("#")
        if not sep or "#" + suffix not in (GAPS, MASK, VALUES) or name not in base:
            raise DeltaError(f"delta entry {key!r} names no tensor of the base")
        changes.setdefault(name, {})["#" + suffix] = tensor
    state: dict[str, torch.Tensor] = {}
    for name, tensor in base.items():
        change = changes.get(name)
        if change is None:
            state[name] = tensor
            continue
        steps = change.get(VALUES)
        kinds = [kind for kind in (GAPS, MASK) if kind in change]
        if steps is None or len(kinds) != 1:
            raise DeltaError(f"{name}: the delta needs one entry of positions and one of steps")
        flat = tensor.detach().reshape(-1).clone()
        positions = _decode_positions(kinds[0], change[kinds[0]].numpy().tobytes(), flat.numel(), name)
        try:
            rows = _unpack(steps.numpy().tobytes())
        except (zlib.error, ValueError, IndexError) as exc:
            raise DeltaError(f"{name}: steps do not decode: {exc}") from None
        width = flat.element_size()
        if rows.shape != (len(positions), width) or (
            len(positions) and (positions[0] < 0 or positions[-1] >= len(flat))
        ):
            raise DeltaError(f"{name}: {len(positions)} positions, {rows.shape[0]} steps of {rows.shape[1]} bytes")
        bits, index = _bits(flat), torch.from_numpy(positions)
        step_bits = torch.from_numpy(rows).view(bits.dtype).reshape(bits[index].shape)
        bits[index] = bits[index] + step_bits  # wraps, as the publisher's difference did
        state[name] = flat.reshape(tensor.shape)
    return state


def reconstruct(
    base: Mapping[str, torch.Tensor], payload: Mapping[str, torch.Tensor], full_sha256: str, version: int
) -> dict[str, torch.Tensor]:
    """`apply_delta`, checked against the version's `full_sha256`: the exact version, or DeltaError."""
    state = apply_delta(base, payload)
    if fingerprint(state) != full_sha256:
        raise DeltaError(f"version {version}: the reconstructed weights' sha256 does not match the published one")
    return state
