"""Sparse deltas between versions: bit-exact reconstruction (bf16, fp32, NaN, -0.0, integers, none
or all changed), sizes that follow the changes, and every wrong input refused."""

from __future__ import annotations

import pytest
import torch

from infra.weights.delta import (
    GAPS,
    MASK,
    VALUES,
    DeltaError,
    apply_delta,
    delta_layout_matches,
    diff,
    encode_delta,
    reconstruct,
)
from infra.weights.manifest import decode, encode, fingerprint


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 64, generator=generator).to(torch.bfloat16),
        "proj": torch.randn(64, 64, generator=generator),
        "half": torch.randn(50, generator=generator).to(torch.float16),
        "steps": torch.arange(40),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3, dtype=torch.bfloat16),
    }


def _changed_copy(state: dict[str, torch.Tensor], fraction: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """A copy with about `fraction` of each float tensor's elements moved by one bf16-sized step."""
    generator = torch.Generator().manual_seed(seed)
    new = {name: tensor.clone() for name, tensor in state.items()}
    for tensor in new.values():
        if tensor.is_floating_point() and tensor.numel():
            flat = tensor.view(-1)
            picked = torch.rand(flat.numel(), generator=generator) < fraction
            flat[picked] = (flat[picked].float() * 1.01 + 0.01).to(flat.dtype)
    if "steps" in new:
        new["steps"][7] += 1
    return new


def _roundtrip(base, state, chunk_bytes: int = 4096) -> dict[str, torch.Tensor]:
    encoded = encode_delta(base, state, version=5, base_version=4, chunk_bytes=chunk_bytes, parent=4)
    assert encoded.manifest.base == 4
    assert encoded.manifest.full_sha256 == fingerprint(state)
    payload = decode(encoded.manifest, encoded.chunks)
    return reconstruct(base, payload, encoded.manifest.full_sha256, 5)


def _assert_bit_equal(rebuilt: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert list(rebuilt) == list(state)
    for name, tensor in state.items():
        assert rebuilt[name].dtype == tensor.dtype and rebuilt[name].shape == tensor.shape, name
        assert torch.equal(rebuilt[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name
    assert fingerprint(rebuilt) == fingerprint(state)


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.3, 1.0])
def test_reconstruction_is_bit_exact(fraction):
    base = _state()
    state = _changed_copy(base, fraction)
    _assert_bit_equal(_roundtrip(base, state), state)


def test_nan_and_signed_zero_are_compared_by_bits():
    base = {"w": torch.tensor([0.0, float("nan"), 1.0, -0.0], dtype=torch.bfloat16)}
    state = {"w": torch.tensor([-0.0, float("nan"), 1.0, 0.0], dtype=torch.bfloat16)}
    nan_bits = state["w"].view(torch.int16).clone()
    nan_bits[1] = 0x7FC1  # another NaN payload than the base's
    state = {"w": nan_bits.view(torch.bfloat16)}
    payload = diff(base, state)
    assert "w" + MASK in payload or "w" + GAPS in payload
    _assert_bit_equal(_roundtrip(base, state), state)
    same_nan = {"w": base["w"].clone()}
    assert diff(base, same_nan) == {}  # NaN == NaN bit for bit: no change


def test_nothing_changed_is_an_empty_payload_that_rebuilds_the_base():
    base = _state()
    state = {name: tensor.clone() for name, tensor in base.items()}
    encoded = encode_delta(base, state, version=2, base_version=1, chunk_bytes=1024)
    assert encoded.manifest.tensors == ()
    assert encoded.manifest.total_bytes < 200
    _assert_bit_equal(_roundtrip(base, state), state)


def test_delta_size_follows_the_fraction_changed():
    generator = torch.Generator().manual_seed(3)
    base = {"w": torch.randn(512, 512, generator=generator).to(torch.bfloat16)}
    whole = encode(base, version=1, chunk_bytes=1 << 20).manifest.total_bytes
    sizes = {}
    for fraction in (0.01, 0.1, 1.0):
        state = _changed_copy(base, fraction, seed=4)
        sizes[fraction] = encode_delta(base, state, 2, 1, 1 << 20).manifest.total_bytes / whole
    assert sizes[0.01] < 0.03  # 2 bytes of value + about 1.3 of position per changed element
    assert sizes[0.01] < sizes[0.1] < sizes[1.0]
    assert sizes[1.0] < 1.01  # all changed: the values and a bitmap that compresses to almost nothing


def test_dense_changes_use_a_bitmap_and_sparse_ones_gaps():
    base = {"w": torch.zeros(100_000, dtype=torch.bfloat16)}
    sparse = {"w": base["w"].clone()}
    sparse["w"][::5000] = 1.0
    dense = {"w": torch.ones(100_000, dtype=torch.bfloat16)}
    dense["w"][::3] = 0.0
    assert "w" + GAPS in diff(base, sparse) and "w" + MASK in diff(base, dense)
    _assert_bit_equal(_roundtrip(base, sparse), sparse)
    _assert_bit_equal(_roundtrip(base, dense), dense)


def test_layout_changes_cannot_be_deltas():
    base = _state()
    renamed = dict(base)
    renamed["other"] = renamed.pop("proj")
    recast = dict(base, proj=base["proj"].double())
    reshaped = dict(base, proj=base["proj"].reshape(32, 128))
    for state in (renamed, recast, reshaped):
        assert not delta_layout_matches(base, state)
        with pytest.raises(ValueError, match="base's tensor names"):
            encode_delta(base, state, 2, 1, 1024)


def test_a_delta_on_the_wrong_base_is_refused_never_applied():
    base = _state()
    state = _changed_copy(base, 0.05)
    encoded = encode_delta(base, state, 2, 1, 1 << 20)
    payload = decode(encoded.manifest, encoded.chunks)
    other_base = _changed_copy(base, 0.05, seed=9)
    with pytest.raises(DeltaError, match="sha256 does not match"):
        reconstruct(other_base, payload, encoded.manifest.full_sha256, 2)
    with pytest.raises(DeltaError, match="names no tensor"):
        apply_delta({"unrelated": torch.zeros(3)}, payload)


def test_malformed_payloads_are_delta_errors():
    base = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    state = {"w": base["w"].clone()}
    state["w"][[3, 500]] = 2.0
    payload = diff(base, state)
    [positions] = [key for key in payload if key != "w" + VALUES]
    broken = dict(payload, **{positions: torch.tensor([1, 2, 3], dtype=torch.uint8)})
    with pytest.raises(DeltaError, match="do not decode"):
        apply_delta(base, broken)
    one_step = diff({"w": base["w"][:1]}, {"w": state["w"][3:4]})["w" + VALUES]
    with pytest.raises(DeltaError, match="2 positions, 1 steps"):
        apply_delta(base, dict(payload, **{"w" + VALUES: one_step}))
    with pytest.raises(DeltaError, match="steps do not decode"):
        apply_delta(base, dict(payload, **{"w" + VALUES: torch.tensor([2, 9, 9], dtype=torch.uint8)}))
    with pytest.raises(DeltaError, match="one entry of positions and one of steps"):
        apply_delta(base, {positions: payload[positions]})
    with pytest.raises(DeltaError, match="names no tensor"):
        apply_delta(base, {"w#bogus": payload["w" + VALUES]})


def test_integer_extremes_wrap_exactly():
    base = {"i": torch.tensor([torch.iinfo(torch.int64).max, torch.iinfo(torch.int64).min, 0, 5])}
    state = {"i": torch.tensor([torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max, -1, 5])}
    _assert_bit_equal(_roundtrip(base, state), state)
    bits = {"b": torch.tensor([-32768, 32767, 0], dtype=torch.int16).view(torch.bfloat16)}
    flipped = {"b": torch.tensor([32767, -32768, -1], dtype=torch.int16).view(torch.bfloat16)}
    _assert_bit_equal(_roundtrip(bits, flipped), flipped)
    complex_base = {"c": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)}
    complex_state = {"c": torch.tensor([1 + 2j, -3 + 1e-300j], dtype=torch.complex128)}
    _assert_bit_equal(_roundtrip(complex_base, complex_state), complex_state)


def test_unchanged_tensors_are_the_bases_own_and_the_base_is_not_modified():
    base = _state()
    before = fingerprint(base)
    state = dict(base, proj=base["proj"] + 1)
    rebuilt = apply_delta(base, diff(base, state))
    assert rebuilt["embed"] is base["embed"]
    assert rebuilt["proj"] is not base["proj"]
    assert fingerprint(base) == before


def test_full_every_below_one_is_one_clear_line_of_the_run_config():
    from infra.run.config import ConfigError, parse_config

    text = "run:\n  name: t\nfabric:\n  weights:\n    full_every: 0\n"
    with pytest.raises(ConfigError) as info:
        parse_config(text, "cfg.yaml")
    assert (
        str(info.value) == "cfg.yaml:5: fabric.weights.full_every: Input should be greater than or equal to 1 (got 0)"
    )
