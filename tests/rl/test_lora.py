"""Tests for rl/lora.py and the torch trainer with `model.lora`: only adapters train, the base is
the KL reference, a version is the adapter tensors, checkpoints hold adapters and refuse the other
kind of run, and the HF engine applies each adapter version in place."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from rl.checkpoint import damage, load_checkpoint, save_checkpoint
from rl.config import GRPOConfig, LoraSettings, OptimConfig
from rl.generation import GenerationRequest
from rl.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    AdapterMismatch,
    LoraTargetError,
    adapter_state,
    add_adapters,
    base_digest,
    load_adapter_state,
    merge_adapters,
    read_adapter,
)
from rl.trainer import WEIGHTS_FILE, CheckpointMismatch
from tests.helpers import hf_on_cpu, run_trainer, save_tiny_model, tiny_model
from tests.rl.test_trainer import random_batch

LORA = LoraSettings(r=4, alpha=8)
PAD, EOS = 0, 2


def lora_trainer(model=None, lora: LoraSettings | None = LORA, kl_coef: float = 0.0, lr: float = 5e-2):
    model = model if model is not None else tiny_model()[0]
    return run_trainer(model, PAD, GRPOConfig(kl_coef=kl_coef), OptimConfig(lr=lr, micro_batch_size=4), lora=lora)


def base_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" not in k}


def test_settings_refuse_a_rank_below_one_and_no_target():
    with pytest.raises(ValidationError, match="r"):
        LoraSettings(r=0)
    with pytest.raises(ValidationError, match="target_modules"):
        LoraSettings(target_modules=())


def test_an_unknown_target_module_is_named_with_the_layers_there_are():
    model, _ = tiny_model()
    with pytest.raises(LoraTargetError, match=r"'q_prj' matches no linear layer.*q_proj"):
        add_adapters(model, LoraSettings(target_modules=("q_proj", "q_prj")))


def test_fresh_adapters_leave_the_base_exactly_and_only_they_train():
    base, _ = tiny_model()
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    expected = base(input_ids=ids).logits
    model = add_adapters(copy.deepcopy(base), LORA)
    assert torch.equal(model(input_ids=ids).logits, expected)  # B = 0: version 0 is the base
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    assert set(adapter_state(model)) == {
        name.replace(".default", "") for name in trainable
    }  # PEFT's file keys drop the adapter's name


def test_a_lora_step_moves_only_the_adapters_and_the_optimizer_holds_only_them():
    trainer = lora_trainer()
    before = base_weights(trainer.model)
    adapters = {k: v.clone() for k, v in adapter_state(trainer.model).items()}
    trainer.train_step(random_batch(empty_response=False))
    after = base_weights(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    moved = adapter_state(trainer.model)
    assert any(not torch.equal(adapters[k], moved[k]) for k in adapters)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    state = trainer.optimizer.state_dict()["state"]
    assert sum(s["exp_avg"].numel() for s in state.values()) == trainable
    assert set(trainer.policy_state()) == set(adapters)  # a version is the adapters alone


def test_the_kl_reference_is_the_base_with_adapters_off():
    trainer = lora_trainer(kl_coef=0.1)
    assert trainer.reference is None  # no second copy of the model
    batch = random_batch(empty_response=False)
    first = trainer.train_step(batch)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy is still the base
    trainer.train_step(batch)
    assert trainer.train_step(batch)["kl"] > 1e-6  # the adapters moved away from the base
    # Switching the adapters off gives the untouched base back:
    base, _ = tiny_model()
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with trainer.model.disable_adapter():
        assert torch.allclose(trainer.model(input_ids=ids).logits, base(input_ids=ids).logits)


def test_merged_weights_equal_peft_merge():
    trainer = lora_trainer()
    trainer.train_step(random_batch(empty_response=False))
    state = trainer.policy_state()
    base = {
        k.removeprefix("base_model.model.").replace(".base_layer", ""): v for k, v in trainer.model.state_dict().items()
    }
    merged = merge_adapters(base, state, LORA.scale)
    assert len(merged) == 2 * 7 * 2 // 2  # 2 layers x 7 targets
    reference = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    for name, weight in merged.items():
        assert torch.allclose(weight, reference[name], atol=1e-6), name


def test_a_lora_checkpoint_round_trips_as_a_peft_adapter(tmp_path):
    trainer = lora_trainer()
    batch = random_batch(empty_response=False)
    trainer.train_step(batch)
    path = save_checkpoint(tmp_path, trainer, {"cursor": 3})
    assert (path / ADAPTER_WEIGHTS_FILE).is_file() and (path / ADAPTER_CONFIG_FILE).is_file()
    assert not (path / WEIGHTS_FILE).exists()  # no copy of the frozen base
    tensors, settings = read_adapter(path)
    assert settings.r == LORA.r and set(tensors) == set(trainer.policy_state())
    resumed = lora_trainer()
    assert load_checkpoint(path, resumed) == {"cursor": 3}
    assert resumed.step == 1
    for name, tensor in trainer.policy_state().items():
        assert torch.equal(resumed.policy_state()[name], tensor)
    assert trainer.train_step(batch)["loss"] == pytest.approx(resumed.train_step(batch)["loss"], abs=1e-6)
    (path / ADAPTER_WEIGHTS_FILE).write_bytes((path / ADAPTER_WEIGHTS_FILE).read_bytes()[:100])
    assert "truncated" in (damage(path) or "") or "header" in (damage(path) or "")


@pytest.mark.parametrize(
    ("saved", "resumed", "message"),
    [
        (LORA, None, "holds LoRA adapters .* this run has no model.lora"),
        (None, LORA, "holds a full fine-tuning run .* this run has model.lora set"),
        (LORA, LoraSettings(r=8), "r=4 .* this run's model.lora is r=8"),
    ],
)
def test_a_checkpoint_of_the_other_kind_is_refused(tmp_path, saved, resumed, message):
    trainer = lora_trainer(lora=saved)
    trainer.train_step(random_batch(empty_response=False))
    path = save_checkpoint(tmp_path, trainer, {})
    with pytest.raises(CheckpointMismatch, match=message):
        load_checkpoint(path, lora_trainer(lora=resumed))


def test_adapter_tensors_that_do_not_fit_are_refused():
    model = add_adapters(tiny_model()[0], LORA)
    state = dict(adapter_state(model))
    name = next(iter(state))
    with pytest.raises(AdapterMismatch, match="1 missing"):
        load_adapter_state(model, {k: v for k, v in state.items() if k != name})
    with pytest.raises(AdapterMismatch, match="shape"):
        load_adapter_state(model, {**state, name: torch.zeros(1)})


def _decode(engine, request: GenerationRequest) -> list[int]:
    engine.add(request)
    tokens: list[int] = []
    while engine.has_work():
        for chunk in engine.step():
            tokens += chunk.token_ids
    return tokens


def test_the_hf_engine_applies_each_adapter_version_in_place():
    trainer = lora_trainer(lr=0.3)
    engine = hf_on_cpu(add_adapters(tiny_model()[0], LORA).eval(), EOS, PAD)
    base_params = {id(p) for p in engine.model.parameters()}
    prompt = [1, 5, 9, 14, 3]
    engine.load_weights(trainer.policy_state(), 0)
    base_tokens = _decode(engine, GenerationRequest("s", prompt, 12, seed=0))
    for _ in range(3):
        trainer.train_step(random_batch(empty_response=False))
    engine.load_weights(trainer.policy_state(), 3)
    assert engine.policy_version == 3
    trained_tokens = _decode(engine, GenerationRequest("s", prompt, 12, seed=0))
    assert trained_tokens != base_tokens  # the new version reached what the engine decodes
    assert {id(p) for p in engine.model.parameters()} == base_params  # in place: no new tensors
    zero = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in trainer.policy_state().items()}
    engine.load_weights(zero, 4)  # B = 0 again: exactly the base's tokens
    assert _decode(engine, GenerationRequest("s", prompt, 12, seed=0)) == base_tokens


def test_base_digest_names_the_weights(tmp_path):
    first = save_tiny_model(tmp_path / "a", seed=0)
    second = save_tiny_model(tmp_path / "b", seed=1)
    assert base_digest(first) == base_digest(save_tiny_model(tmp_path / "c", seed=0))
    assert base_digest(first) != base_digest(second)
