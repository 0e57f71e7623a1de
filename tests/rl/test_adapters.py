"""Tests for rl/adapters.py: the weights a LoRA version gives the vLLM engine to reload (its adapted
layers merged as peft merges them, their fused siblings at the base's values, version 0 the base
exactly), read from a real saved model directory, and the one-line errors for what does not fit."""

from __future__ import annotations

import pytest
import torch

from rl.adapters import MergedAdapters
from rl.config import LoraSettings
from rl.lora import AdapterMismatch, LoraTargetError, adapter_state, add_adapters, load_adapter_state
from rl.models import load_model
from tests.helpers import save_tiny_model, tiny_shape

SETTINGS = LoraSettings(r=4, alpha=8.0, target_modules=("q_proj", "up_proj"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tiny_shape())


def random_version(model_dir, settings: LoraSettings, seed: int = 1):
    """An adapted model whose adapters are random (B no longer zero) and its adapter state."""
    model = add_adapters(load_model(model_dir)[0], settings)
    generator = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(t.shape, generator=generator) * 0.3 for name, t in adapter_state(model).items()}
    load_adapter_state(model, state)
    return model, state


def test_a_version_merges_the_adapted_layers_as_peft_does_and_completes_their_fused_groups(model_dir):
    adapters = MergedAdapters(model_dir, SETTINGS, torch.float32)
    layers = range(tiny_shape().num_layers)
    assert adapters.modules == {
        *(f"model.layers.{i}.self_attn.q_proj" for i in layers),
        *(f"model.layers.{i}.mlp.up_proj" for i in layers),
    }
    model, state = random_version(model_dir, SETTINGS)
    weights = adapters.weights(state)
    # every tensor of the modules holding an adapted layer: q's siblings k, v, o; up's gate, down
    assert set(weights) == {
        f"model.layers.{i}.{part}.weight"
        for i in layers
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }
    merged = model.merge_and_unload().state_dict()  # pyright: ignore[reportCallIssue]
    base = load_model(model_dir)[0].state_dict()
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6)
        assert torch.equal(tensor, base[name]) == (name.rsplit(".", 2)[1] not in SETTINGS.target_modules)


def test_version_0_gives_the_base_weights_exactly_in_the_engine_dtype(model_dir):
    adapters = MergedAdapters(model_dir, SETTINGS, torch.bfloat16)
    fresh = adapter_state(add_adapters(load_model(model_dir)[0], SETTINGS))  # B = 0
    base = load_model(model_dir)[0].state_dict()
    weights = adapters.weights(fresh)
    assert weights and all(tensor.dtype == torch.bfloat16 for tensor in weights.values())
    assert all(torch.equal(tensor, base[name].to(torch.bfloat16)) for name, tensor in weights.items())


def test_a_target_without_its_own_weight_names_the_key(model_dir):
    """The tiny model ties lm_head to the embeddings: the checkpoint has no lm_head weight."""
    with pytest.raises(LoraTargetError, match=r"model.lora.target_modules: 'lm_head' matches no weight in .*tied"):
        MergedAdapters(model_dir, LoraSettings(target_modules=("q_proj", "lm_head")), torch.float32)


def test_a_version_of_other_targets_or_rank_is_refused(model_dir):
    adapters = MergedAdapters(model_dir, SETTINGS, torch.float32)
    _, other_targets = random_version(model_dir, LoraSettings(r=4, target_modules=("q_proj",)))
    with pytest.raises(AdapterMismatch, match=r"does not fit this engine's model.lora .*2 adapted layers missing"):
        adapters.weights(other_targets)
    _, other_rank = random_version(model_dir, SETTINGS.model_copy(update={"r": 8}))
    with pytest.raises(AdapterMismatch, match=r"do not fit its weight .* at model.lora.r 4"):
        adapters.weights(other_rank)


def test_a_directory_without_safetensors_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors file.*rlboost import-model"):
        MergedAdapters(tmp_path, SETTINGS, torch.float32)
