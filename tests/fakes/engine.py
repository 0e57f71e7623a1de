"""`ScriptedEngine`: a deterministic `GenerationEngine` without a model, for tests of the rollout
fabric that run real workers (`infra.rollout.worker.RolloutWorker`) but need no model.

A sample's token at response position p is `scripted_token(sample_id, p)`, a pure function of the
two, so a sample resumed anywhere from its logged tokens, on any engine, continues exactly as if it
had never been interrupted, and a test knows every response in advance (`scripted_response`). Its
length comes from the `length` function the test gives (it finishes with "stop", or with "length"
at the request's budget). Each `step()` advances every live request by one token and takes
`step_s` seconds, like a model's decode step; the engine records every request it was given and
every sample released from it.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Mapping

from rl.generation import FINISH_LENGTH, FINISH_STOP, GenerationEngine, GenerationRequest, TokenChunk


def scripted_token(sample_id: str, position: int) -> int:
    return zlib.crc32(f"{sample_id}@{position}".encode()) % 50_000 + 1


def scripted_response(sample_id: str, length: int) -> list[int]:
    return [scripted_token(sample_id, p) for p in range(length)]


SCRIPTED_LOGPROB = -1.0
"""The log-prob reported for every scripted token."""


class ScriptedEngine(GenerationEngine):
    """Generates `scripted_response(sample_id, length(sample_id))` (capped by the budget)."""

    def __init__(self, length: Callable[[str], int], *, step_s: float = 0.0, policy_version: int = 0) -> None:
        self.length = length
        self.step_s = step_s
        self.running = threading.Event()
        """Set: `step` generates; cleared by a test, `step` waits for it (the instance holds its
        samples, generating nothing, and goes on heartbeating)."""
        self.running.set()
        self.policy_version = policy_version
        self.requests: list[GenerationRequest] = []
        """Every request added, in order (a resumed one carries its logged tokens)."""
        self.released: list[str] = []
        """Every sample released while live, in order."""
        self._live: dict[str, tuple[GenerationRequest, list[int]]] = {}
        self._lock = threading.Lock()
        """Tests read `requests` and `released` while the worker's thread drives the engine."""

    def add(self, request: GenerationRequest) -> None:
        with self._lock:
            if request.sample_id in self._live:
                raise ValueError(f"sample {request.sample_id!r} is already live")
            self.requests.append(request)
            self._live[request.sample_id] = (request, list(request.generated_ids))

    def release(self, sample_id: str) -> list[int]:
        with self._lock:
            _, tokens = self._live.pop(sample_id)
            self.released.append(sample_id)
            return tokens

    def step(self) -> list[TokenChunk]:
        self.running.wait()
        time.sleep(self.step_s)
        chunks = []
        with self._lock:
            for sample_id, (request, tokens) in list(self._live.items()):
                tokens.append(scripted_token(sample_id, len(tokens)))
                finish = None
                if len(tokens) >= self.length(sample_id):
                    finish = FINISH_STOP
                elif len(tokens) >= request.max_new_tokens:
                    finish = FINISH_LENGTH
                chunks.append(TokenChunk(sample_id, tokens[-1:], [SCRIPTED_LOGPROB], finish))
                if finish is not None:
                    del self._live[sample_id]
        return chunks

    def has_work(self) -> bool:
        return bool(self._live)

    def num_active(self) -> int:
        return len(self._live)

    def load_weights(self, state_dict: Mapping, version: int) -> None:
        self.policy_version = version

    def added(self) -> dict[str, list[int]]:
        """Sample id -> the logged tokens it came with, for every request added."""
        with self._lock:
            return {r.sample_id: list(r.generated_ids) for r in self.requests}
