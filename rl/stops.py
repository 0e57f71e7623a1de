"""Stop strings for every engine: `StopStrings` wraps any `GenerationEngine` (HF, vLLM) and ends a
sample at the first token whose decoded text completes one of its request's
`SamplingParams.stop` strings (in the text as decoded with special tokens skipped, the text the
rewards see: a stop string never matches inside a special token's name).

Engine-agnostic on purpose: the engines' sampling is untouched, and the stop strings travel with
the request (in the token log, with the group's `sampling`), so a sample released on one instance
and resumed on another stops exactly where an uninterrupted one would. After each inner step the
wrapper appends each tracked sample's new tokens to its response and decodes only a tail window of
it (`window_tokens`: enough tokens for the longest stop string, plus slack for tokenizers whose
first token decodes differently out of context), so checking costs O(window) per token, not
O(length). A hit cuts the chunk after the completing token, releases the sample from the inner
engine and reports finish_reason "stop". A resumed sample whose logged prefix already holds a
stop string in its current turn (`GenerationRequest.turn_start`: a trajectory's earlier turns
ended at theirs) finishes on arrival with no new tokens (it stopped before it could be reported).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rl.generation import FINISH_STOP, GenerationEngine, GenerationRequest, TokenChunk

if TYPE_CHECKING:
    import torch

WINDOW_SLACK = 8
"""Tokens decoded beyond the longest stop string's length in characters (each token decodes to
at least one character except in rare byte-fallback cases; the slack also covers a window whose
first token decodes without its leading space)."""


def window_tokens(stops: Sequence[str]) -> int:
    """How many trailing tokens are decoded to look for `stops` (a token is >= 1 character)."""
    return max(map(len, stops)) + WINDOW_SLACK


def find_stop(tokenizer, response: Sequence[int], new: int, stops: Sequence[str]) -> int | None:
    """Index into `response` of the first of its last `new` tokens that completes one of `stops`:
    the decoded tail window ending at that token contains it and the same window without that
    token does not (the second decode only on a hit, so a token costs one window decode); None
    if none does."""
    window = window_tokens(stops)
    for index in range(len(response) - new, len(response)):
        start = max(0, index + 1 - window)
        text = tokenizer.decode(list(response[start : index + 1]), skip_special_tokens=True)
        if not any(stop in text for stop in stops):
            continue
        before = tokenizer.decode(list(response[start:index]), skip_special_tokens=True)
        if any(stop in text and stop not in before for stop in stops):
            return index
    return None


class StopStrings(GenerationEngine):
    """`inner` with stop strings applied (requests without any pass through untouched)."""

    def __init__(self, inner: GenerationEngine, tokenizer) -> None:
        self.inner = inner
        self.tokenizer = tokenizer
        self._tracked: dict[str, tuple[tuple[str, ...], list[int]]] = {}
        """Samples with stop strings: their strings and their response so far."""
        self._stopped_on_arrival: list[str] = []

    @property
    def policy_version(self) -> int:  # type: ignore[override]
        return self.inner.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.inner.policy_version = version

    def add(self, request: GenerationRequest) -> None:
        stops = request.sampling.stop
        if request.sample_id in self._tracked:
            raise ValueError(f"sample_id {request.sample_id!r} is already live in this engine")
        if not stops:
            self.inner.add(request)
            return
        prefix = list(request.generated_ids)
        turn = prefix[request.turn_start :]
        if turn and any(stop in self.tokenizer.decode(turn, skip_special_tokens=True) for stop in stops):
            self._stopped_on_arrival.append(request.sample_id)
        else:
            self.inner.add(request)
        self._tracked[request.sample_id] = (stops, prefix)

    def release(self, sample_id: str) -> list[int]:
        if sample_id in self._stopped_on_arrival:
            self._stopped_on_arrival.remove(sample_id)
            return list(self._tracked.pop(sample_id)[1])
        response = self.inner.release(sample_id)  # KeyError for an unknown id
        self._tracked.pop(sample_id, None)
        return response

    def step(self) -> list[TokenChunk]:
        chunks = [TokenChunk(sample_id, [], [], FINISH_STOP) for sample_id in self._stopped_on_arrival]
        for sample_id in self._stopped_on_arrival:
            del self._tracked[sample_id]
        self._stopped_on_arrival.clear()
        for chunk in self.inner.step():
            tracked = self._tracked.get(chunk.sample_id)
            if tracked is not None:
                stops, response = tracked
                before = len(response)
                response += chunk.token_ids
                at = find_stop(self.tokenizer, response, len(chunk.token_ids), stops)
                if at is not None:
                    if chunk.finish_reason is None:
                        self.inner.release(chunk.sample_id)
                    keep = at + 1 - before
                    del response[at + 1 :]
                    chunk = TokenChunk(chunk.sample_id, chunk.token_ids[:keep], chunk.logprobs[:keep], FINISH_STOP)
                if chunk.finish_reason is not None:
                    del self._tracked[chunk.sample_id]
            chunks.append(chunk)
        return chunks

    def has_work(self) -> bool:
        return bool(self._stopped_on_arrival) or self.inner.has_work()

    def num_active(self) -> int:
        return len(self._stopped_on_arrival) + self.inner.num_active()

    def close(self) -> None:
        self.inner.close()

    def sleep(self) -> None:
        if self._stopped_on_arrival:
            raise RuntimeError("sleep() needs an idle engine: samples are still to be reported")
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.inner.load_weights(state_dict, version)
