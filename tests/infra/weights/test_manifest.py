"""A version as manifest + safetensors chunks: round trip, tied weights, chunking, verification."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_safetensors

from infra.weights.manifest import (
    Manifest,
    ManifestError,
    chunk_is_valid,
    decode,
    encode,
    fingerprint,
)


class _TiedLM(torch.nn.Module):
    """Embedding and output head sharing one weight, like a tied-embedding language model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def _mixed_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    base = torch.randn(40, 30)
    return {
        "f32": base,
        "f32.transposed": base.t(),  # non-contiguous view of the same storage
        "bf16": torch.randn(17, 3).to(torch.bfloat16),
        "f16": torch.randn(5).to(torch.float16),
        "i64": torch.arange(11),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 7),
    }


def _assert_same(decoded: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> None:
    assert list(decoded) == list(original)
    for name, tensor in original.items():
        assert decoded[name].dtype == tensor.dtype, name
        assert decoded[name].shape == tensor.shape, name
        assert torch.equal(decoded[name], tensor), name


@pytest.mark.parametrize("chunk_bytes", [1, 100, 1000, 1 << 20])
def test_round_trip_keeps_names_dtypes_shapes_and_values(chunk_bytes):
    state_dict = _mixed_state_dict()
    encoded = encode(state_dict, version=3, chunk_bytes=chunk_bytes, parent=2)
    _assert_same(decode(encoded.manifest, encoded.chunks), state_dict)
    assert fingerprint(decode(encoded.manifest, encoded.chunks)) == fingerprint(state_dict)


def test_tied_weights_come_back_as_separate_tensors_that_load_strictly():
    model = _TiedLM()
    state_dict = model.state_dict()
    assert state_dict["head.weight"].data_ptr() == state_dict["embed.weight"].data_ptr()
    encoded = encode(state_dict, version=1, chunk_bytes=1024)
    decoded = decode(encoded.manifest, encoded.chunks)
    assert decoded["head.weight"].data_ptr() != decoded["embed.weight"].data_ptr()
    fresh = _TiedLM()
    fresh.load_state_dict(decoded, strict=True)
    assert torch.equal(fresh.head.weight, model.embed.weight)


def test_large_tensors_are_split_and_chunks_stay_near_the_target_size():
    state_dict = {"big": torch.randn(10_000), "small": torch.randn(10), "big2": torch.randn(3000, 3)}
    chunk_bytes = 4096
    encoded = encode(state_dict, version=0, chunk_bytes=chunk_bytes)
    pieces = {info.name: info.pieces for info in encoded.manifest.tensors}
    assert len(pieces["big"]) == 10  # 40,000 bytes over 4,096-byte chunks
    assert [(p.start, p.stop) for p in pieces["big"]][0] == (0, 1024)
    for data in encoded.chunks:
        payload = sum(t.numel() * t.element_size() for t in load_safetensors(data).values())
        assert payload <= chunk_bytes
    _assert_same(decode(encoded.manifest, encoded.chunks), state_dict)


def test_manifest_describes_every_chunk_and_survives_json():
    state_dict = _mixed_state_dict()
    encoded = encode(state_dict, version=7, chunk_bytes=256, parent=6, created=1234.5)
    manifest = encoded.manifest
    assert (manifest.version, manifest.parent, manifest.created) == (7, 6, 1234.5)
    assert [c.index for c in manifest.chunks] == list(range(len(encoded.chunks)))
    assert len({c.file for c in manifest.chunks}) == len(manifest.chunks)
    assert manifest.total_bytes == sum(len(data) for data in encoded.chunks)
    assert all(chunk_is_valid(info, data) for info, data in zip(manifest.chunks, encoded.chunks))
    assert Manifest.from_bytes(encoded.manifest_bytes) == manifest
    assert [(t.name, t.dtype, list(t.shape)) for t in manifest.tensors][:3] == [
        ("f32", "float32", [40, 30]),
        ("f32.transposed", "float32", [30, 40]),
        ("bf16", "bfloat16", [17, 3]),
    ]


def test_encoding_is_deterministic():
    state_dict = _mixed_state_dict()
    first = encode(state_dict, version=1, chunk_bytes=300, created=1.0)
    second = encode(state_dict, version=1, chunk_bytes=300, created=1.0)
    assert first.manifest_sha256 == second.manifest_sha256
    assert first.chunks == second.chunks


def test_corrupt_or_truncated_chunks_are_rejected():
    encoded = encode({"w": torch.randn(100)}, version=1, chunk_bytes=1 << 20)
    info, data = encoded.manifest.chunks[0], encoded.chunks[0]
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    assert chunk_is_valid(info, data)
    assert not chunk_is_valid(info, bytes(flipped))
    assert not chunk_is_valid(info, data[:-1])


def test_decode_rejects_a_manifest_that_does_not_match_the_chunks():
    encoded = encode({"w": torch.randn(4, 4)}, version=1, chunk_bytes=1 << 20)
    wrong_shape = encoded.manifest.model_copy(
        update={"tensors": (encoded.manifest.tensors[0].model_copy(update={"shape": (5, 4)}),)}
    )
    with pytest.raises(ManifestError, match="w decodes to"):
        decode(wrong_shape, encoded.chunks)
    with pytest.raises(ManifestError, match="chunks given"):
        decode(encoded.manifest, [])
