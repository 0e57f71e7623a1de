"""Stop strings (rl/stops.py): the pure search over a tail window, and `StopStrings` around the
real HF engine on a tiny model: a stop string ends the response after its completing token, with
the engine's own tokens and log-probs up to there, and a sample released before its stop and
resumed on another engine stops at the same token."""

from __future__ import annotations

import pytest

from rl.generation import FINISH_STOP, GenerationRequest, SamplingParams
from rl.models import build_tiny_llama
from rl.stops import StopStrings, find_stop, window_tokens
from tests.helpers import hf_on_cpu, resumed, run_and_release, tiny_shape

SHAPE = tiny_shape(smallest=True)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = build_tiny_llama(SHAPE, seed=3)
    return model.eval(), tokenizer


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


class CountingTokenizer:
    """The real tokenizer, recording how many tokens each decode call was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids, **kwargs) -> str:
        self.lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)


# --- the pure part -------------------------------------------------------------------------------


def test_find_stop_returns_the_completing_token(tiny):
    _, tokenizer = tiny
    response = ids(tokenizer, "so 7+5=12 #### 12\n\nmore")
    at = find_stop(tokenizer, response, len(response), ["####"])
    assert tokenizer.decode(response[: at + 1], skip_special_tokens=True) == "so 7+5=12 ####"
    at = find_stop(tokenizer, response, len(response), ["\n\n", "####"])  # the first to complete wins
    assert tokenizer.decode(response[: at + 1], skip_special_tokens=True) == "so 7+5=12 ####"
    assert find_stop(tokenizer, response, len(response), ["nope"]) is None
    # Only the last `new` tokens are candidates, and one that merely follows a stop completes none.
    assert find_stop(tokenizer, response, 3, ["####"]) is None
    assert find_stop(tokenizer, response, 3, ["more"]) == len(response) - 1


def test_stop_strings_never_match_inside_special_tokens(tiny):
    _, tokenizer = tiny
    response = ids(tokenizer, "12") + [tokenizer.pad_token_id, tokenizer.eos_token_id]  # "<pad>", "<eos>"
    assert find_stop(tokenizer, response, len(response), ["pad", "<", "eos"]) is None


def test_find_stop_decodes_a_bounded_tail_window(tiny):
    _, tokenizer = tiny
    counting = CountingTokenizer(tokenizer)
    response = ids(tokenizer, "x" * 2000 + "STOP")
    assert find_stop(counting, response, 1, ["STOP"]) == len(response) - 1
    window = window_tokens(["STOP"])
    assert counting.lengths == [window, window - 1]  # the hit, then the window without it; not 2004
    assert window_tokens(["a", "longer one"]) == len("longer one") + 8


def test_sampling_params_carry_stop_strings_from_json():
    assert SamplingParams(stop=["####", "\n\n"]).stop == ("####", "\n\n")  # a JSON list
    assert SamplingParams() == SamplingParams(stop=())
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="####")  # a string, not a sequence of strings


# --- with the HF engine --------------------------------------------------------------------------


def make_requests(tokenizer, stop=(), max_new: int = 40) -> list[GenerationRequest]:
    prompts = ["12+34=", "7+8+9=", "100+1=", "5+5="]
    return [
        GenerationRequest(f"s{i}", ids(tokenizer, p), max_new, seed=11, sampling=SamplingParams(stop=tuple(stop)))
        for i, p in enumerate(prompts)
    ]


def engine_of(tiny, batch: int = 8) -> StopStrings:
    model, tokenizer = tiny
    return StopStrings(
        hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_batch_size=batch), tokenizer
    )


def a_stop_string(tokenizer, results) -> str:
    """Two characters found mid-response in the longest sample (the tiny model's output is noise)."""
    text = tokenizer.decode(max((r.token_ids for r in results), key=len), skip_special_tokens=True)
    assert len(text) >= 12
    return text[10:12]


def test_a_stop_string_ends_the_response_after_its_completing_token(tiny):
    _, tokenizer = tiny
    plain = engine_of(tiny).generate(make_requests(tokenizer))
    stop = a_stop_string(tokenizer, plain)
    stopped = engine_of(tiny).generate(make_requests(tokenizer, stop=[stop]))
    hits = 0
    for want, got in zip(plain, stopped):
        at = find_stop(tokenizer, want.token_ids, len(want.token_ids), [stop])
        if at is None:
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
            continue
        hits += 1
        assert got.finish_reason == FINISH_STOP
        assert got.token_ids == want.token_ids[: at + 1]
        assert got.new_logprobs == pytest.approx(want.new_logprobs[: at + 1])
        assert tokenizer.decode(got.token_ids, skip_special_tokens=True).endswith(stop)
        assert stop not in tokenizer.decode(got.token_ids[:-1], skip_special_tokens=True)
    assert hits >= 1


def test_requests_without_stop_strings_pass_through(tiny):
    model, tokenizer = tiny
    raw = hf_on_cpu(model, tokenizer.eos_token_id, tokenizer.pad_token_id).generate(make_requests(tokenizer))
    wrapped = engine_of(tiny).generate(make_requests(tokenizer))
    assert [r.token_ids for r in wrapped] == [r.token_ids for r in raw]


def test_a_sample_released_before_its_stop_resumes_elsewhere_and_stops_at_the_same_token(tiny):
    _, tokenizer = tiny
    plain = engine_of(tiny).generate(make_requests(tokenizer))
    stop = a_stop_string(tokenizer, plain)
    requests = make_requests(tokenizer, stop=[stop])
    want = {r.sample_id: r.token_ids for r in engine_of(tiny).generate(requests)}
    first = engine_of(tiny, batch=2)
    partial = run_and_release(first, requests, {r.sample_id: 5 + 2 * i for i, r in enumerate(requests)})
    second = engine_of(tiny)
    results = second.generate([resumed(r, partial[r.sample_id]) for r in requests])
    assert {r.sample_id: r.token_ids for r in results} == want
    assert not first.has_work() and not second.has_work()


def test_a_resumed_prefix_that_already_holds_a_stop_finishes_on_arrival(tiny):
    _, tokenizer = tiny
    engine = engine_of(tiny)
    request = make_requests(tokenizer, stop=["##"])[0]
    prefix = ids(tokenizer, "12 ## 3")
    engine.add(resumed(request, prefix))
    assert engine.has_work() and engine.num_active() == 1
    chunks = engine.step()
    assert [(c.sample_id, c.token_ids, c.finish_reason) for c in chunks] == [("s0", [], FINISH_STOP)]
    assert not engine.has_work()


def test_release_and_policy_version_reach_the_inner_engine(tiny):
    _, tokenizer = tiny
    engine = engine_of(tiny)
    engine.policy_version = 4
    assert engine.inner.policy_version == 4 and engine.policy_version == 4
    request = make_requests(tokenizer, stop=["@@@@"])[1]
    engine.add(request)
    engine.step()
    engine.step()
    assert len(engine.release("s1")) == 2
    assert not engine.has_work()
    with pytest.raises(KeyError):
        engine.release("s1")
    with pytest.raises(ValueError, match="already live"):
        engine.add(request)
        engine.add(request)
