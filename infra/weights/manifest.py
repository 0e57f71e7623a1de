"""A policy version as bytes: the `Manifest` and its safetensors chunks.

`encode` turns a state dict into an `EncodedVersion`: the tensors packed in order into chunks of
about `chunk_bytes` (a tensor larger than that is split, by flat element range, across several
chunks), each chunk a self-contained safetensors file held as bytes, and a `Manifest` naming every
tensor's dtype, shape and pieces and every chunk's file name, size and sha256. `decode` is the
inverse: verified chunk bytes back to a state dict equal to the original, copying every byte once.

Every tensor is stored as its own contiguous CPU copy: tied weights
(e.g. `lm_head.weight` and `embed_tokens.weight`) are transferred twice and come back as two
tensors, so `load_state_dict(strict=True)` works.

The manifest's own sha256 (`EncodedVersion.manifest_sha256`) is what the publisher records in
Redis; with it a puller verifies the manifest it got from any source, and through the manifest
every chunk.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import save as save_safetensors

MANIFEST_FILE = "manifest.json"


class ManifestError(ValueError):
    """A manifest or a chunk does not match what it should be."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorPiece(_Model):
    """A flat element range [start, stop) of a tensor, stored under `key` in chunk `chunk`."""

    chunk: int = Field(ge=0)
    key: str
    start: int = Field(ge=0)
    stop: int = Field(ge=0)


class TensorInfo(_Model):
    name: str
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. `bfloat16`."""
    shape: tuple[int, ...]
    pieces: tuple[TensorPiece, ...]
    """In element order; together they cover the tensor exactly."""


class ChunkInfo(_Model):
    index: int = Field(ge=0)
    file: str
    """File name inside the version's directory (in the store and on peer servers)."""
    size: int = Field(ge=0)
    sha256: str


class Manifest(_Model):
    version: int = Field(ge=0)
    parent: int | None = None
    """The version this one was trained from (None for the first)."""
    created: float
    """Unix seconds when the trainer published the version."""
    base: int | None = None
    """None: the chunks hold the whole version. Else they hold a delta against version `base`
    (`infra.weights.delta`), which rebuilds the version whose `fingerprint` is `full_sha256`."""
    full_sha256: str | None = None
    """The `fingerprint` of the whole version a delta rebuilds (None for a whole version)."""
    adapter_base: str | None = None
    """With LoRA (`model.lora`): the tensors are adapters, applied to the base model whose weights
    have this sha256 (`rl.lora.base_digest`); None: they are the whole model."""
    tensors: tuple[TensorInfo, ...]
    chunks: tuple[ChunkInfo, ...]

    @property
    def total_bytes(self) -> int:
        return sum(chunk.size for chunk in self.chunks)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        return cls.model_validate_json(data)


@dataclass(frozen=True)
class EncodedVersion:
    """A complete version, ready to serve or upload: its manifest (parsed, and the exact bytes
    whose sha256 the trainer recorded) and its chunk bytes (index i = chunk i)."""

    manifest: Manifest
    manifest_bytes: bytes
    chunks: tuple[bytes, ...]

    @property
    def version(self) -> int:
        return self.manifest.version

    @cached_property
    def manifest_sha256(self) -> str:
        return sha256_hex(self.manifest_bytes)


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def chunk_file(index: int) -> str:
    return f"chunk-{index:05d}.safetensors"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r} in manifest")
    return dtype


class _ChunkPacker:
    """Packs flat tensors in order into chunks of at most `chunk_bytes` (one element at least).

    A tensor that does not fit in the current chunk's remaining room starts a new chunk; one
    larger than a whole chunk fills chunks of its own and its tail shares with what follows.
    """

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.chunks: list[dict[str, torch.Tensor]] = [{}]
        self._fill = 0

    def add(self, name: str, flat: torch.Tensor) -> tuple[TensorPiece, ...]:
        element = max(1, flat.element_size())
        per_chunk = max(1, self.chunk_bytes // element)
        pieces = []
        start = 0
        while True:
            room = (self.chunk_bytes - self._fill) // element
            if self._fill and room < min(flat.numel() - start, per_chunk):
                self.chunks.append({})
                self._fill, room = 0, per_chunk
            stop = min(flat.numel(), start + max(1, room))
            key = name if (start, stop) == (0, flat.numel()) else f"{name}[{start}:{stop}]"
            self.chunks[-1][key] = flat[start:stop].clone()
            self._fill += (stop - start) * element
            pieces.append(TensorPiece(chunk=len(self.chunks) - 1, key=key, start=start, stop=stop))
            start = stop
            if start >= flat.numel():
                return tuple(pieces)


def encode(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    chunk_bytes: int,
    parent: int | None = None,
    created: float | None = None,
    base: int | None = None,
    full_sha256: str | None = None,
    adapter_base: str | None = None,
) -> EncodedVersion:
    """Chunk `state_dict` into safetensors byte chunks of about `chunk_bytes` each (`base` and
    `full_sha256`: the state dict is a delta payload, `infra.weights.delta`; `adapter_base`: it
    holds LoRA adapters of that base, `Manifest.adapter_base`)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    packer = _ChunkPacker(chunk_bytes)
    infos = [
        TensorInfo(
            name=name,
            dtype=_dtype_name(tensor.dtype),
            shape=tuple(tensor.shape),
            pieces=packer.add(name, tensor.detach().to("cpu").contiguous().reshape(-1)),
        )
        for name, tensor in state_dict.items()
    ]
    blobs = tuple(save_safetensors(tensors) for tensors in packer.chunks)
    chunks = tuple(
        ChunkInfo(index=i, file=chunk_file(i), size=len(blob), sha256=sha256_hex(blob)) for i, blob in enumerate(blobs)
    )
    manifest = Manifest(
        version=version,
        parent=parent,
        created=time.time() if created is None else created,
        base=base,
        full_sha256=full_sha256,
        adapter_base=adapter_base,
        tensors=tuple(infos),
        chunks=chunks,
    )
    return EncodedVersion(manifest=manifest, manifest_bytes=manifest.to_bytes(), chunks=blobs)


def chunk_is_valid(info: ChunkInfo, data: bytes | bytearray | memoryview) -> bool:
    """Whether `data` is exactly the chunk the manifest describes (size and sha256)."""
    return len(data) == info.size and sha256_hex(data) == info.sha256


def fingerprint(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in order: equal state dicts, equal
    fingerprints (to compare what two processes hold without moving the tensors)."""
    digest = hashlib.sha256()
    for name, tensor in state_dict.items():
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{_dtype_name(tensor.dtype)}|{list(tensor.shape)}|".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def _safetensors_layout(data: bytes) -> tuple[int, dict]:
    """(offset of the data section, header) of a safetensors file held in memory: an 8-byte
    little-endian header size, the JSON header, then the tensors' bytes."""
    size = int.from_bytes(data[:8], "little")
    if len(data) < 8 or 8 + size > len(data):
        raise ManifestError("chunk is not a safetensors file")
    return 8 + size, json.loads(data[8 : 8 + size])


def decode(manifest: Manifest, chunks: Sequence[bytes]) -> dict[str, torch.Tensor]:
    """The state dict of a version from its (already verified) chunk bytes, in manifest order.

    Each tensor is allocated once and its pieces are copied straight from the chunks' bytes (read
    through their safetensors headers), with no intermediate tensors."""
    if len(chunks) != len(manifest.chunks):
        raise ManifestError(
            f"version {manifest.version}: {len(chunks)} chunks given, manifest lists {len(manifest.chunks)}"
        )
    layouts = [_safetensors_layout(data) for data in chunks]
    state_dict: dict[str, torch.Tensor] = {}
    for info in manifest.tensors:
        numel = math.prod(info.shape)
        flat = torch.empty(numel, dtype=_dtype(info.dtype))
        destination = flat.view(torch.uint8).numpy()
        element = flat.element_size()
        covered = 0
        for piece in info.pieces:
            data_start, header = layouts[piece.chunk]
            begin, end = header.get(piece.key, {}).get("data_offsets", (0, -1))
            size = (piece.stop - piece.start) * element
            if end - begin != size or piece.start != covered or data_start + end > len(chunks[piece.chunk]):
                raise ManifestError(
                    f"version {manifest.version}: piece {piece.key} of {info.name} does not match chunk {piece.chunk}"
                )
            destination[piece.start * element : piece.stop * element] = np.frombuffer(
                chunks[piece.chunk], dtype=np.uint8, count=size, offset=data_start + begin
            )
            covered = piece.stop
        if covered != numel:
            raise ManifestError(
                f"version {manifest.version}: {info.name} decodes to {covered} elements, manifest says {list(info.shape)}"
            )
        state_dict[info.name] = flat.reshape(info.shape)
    return state_dict
