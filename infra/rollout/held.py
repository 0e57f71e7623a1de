"""The samples a rollout worker holds (docs/internals.md §4): each one's lease, the response tokens
logged and those generated since, which of them are due to flush (`due`), the fenced flushes that
log them (`flushes`) and what an accepted flush changes (`Held.logged_ok`). A multi-turn
trajectory's sample also has its `infra.rollout.trajectory.Episode`: the engine ending one of its
model turns ends the turn (`turn_end`), not the sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

from infra.rollout.tokenlog import Claim, Flush, Outcome
from rl.generation import GenerationRequest, TokenChunk

if TYPE_CHECKING:
    from infra.rollout.trajectory import Episode


@dataclass(eq=False)
class Held:
    """A leased sample: what is logged and what is buffered."""

    sample_id: str
    epoch: int
    logged: int
    """Response tokens in the log."""
    order: int
    """Claim order (a tie-break for choosing samples to release)."""
    claim: Claim
    """The lease as claimed (to continue the sample on a new version: `RolloutWorker._reload`)."""
    prefix: list[int] = field(default_factory=list)
    """The logged response tokens (the claim's and those flushed since)."""
    tokens: list[int] = field(default_factory=list)
    """Generated, not yet flushed."""
    logprobs: list[float] = field(default_factory=list)
    since: float = 0.0
    """Monotonic time of the oldest unflushed token."""
    finish: str | None = None
    episode: Episode | None = None
    """A trajectory's environment state (None: a single-turn sample)."""
    turn_start: int = 0
    """Where the current model turn starts in the response (after the last environment segment)."""
    turn_end: str | None = None
    """The engine's finish reason of a trajectory's model turn that ended: its tokens are flushed,
    then its environment answers it (None while the turn is generating)."""
    outcome: Outcome | None = None
    """How a finished trajectory ended (logged with its finishing flush)."""
    segment: Segment | None = None
    """The environment segment answering the turn that ended, to be logged (an env flush)."""
    turn_ended_at: float = 0.0
    """Monotonic time the engine ended the current model turn."""
    env_s: float = 0.0
    """Seconds of the environment step that answered the turn (logged with its env or finishing flush)."""
    wait_s: float = 0.0
    """Seconds from the turn's end to that answer (logged likewise)."""

    @property
    def generated(self) -> int:
        return self.logged + len(self.tokens)

    def absorb(self, chunk: TokenChunk, now: float) -> int:
        """Buffer an engine step's tokens (and finish) of this sample; returns how many tokens."""
        if chunk.token_ids:
            if not self.tokens:
                self.since = now
            self.tokens += chunk.token_ids
            self.logprobs += chunk.logprobs
        if chunk.finish_reason is not None:
            if self.episode is None:
                self.finish = chunk.finish_reason
            else:
                self.turn_end, self.turn_ended_at = chunk.finish_reason, now
        return len(chunk.token_ids)

    def request(self) -> GenerationRequest:
        """The engine request that continues the sample from its logged tokens (its current turn)."""
        request = replace(self.claim, generated_ids=list(self.prefix)).request()
        request.turn_start = self.turn_start
        return request

    def logged_ok(self, count: int, submitted: float) -> None:
        """A flush of the first `count` buffered tokens, submitted at `submitted`, was accepted."""
        self.logged += count
        self.prefix += self.tokens[:count]
        del self.tokens[:count], self.logprobs[:count]
        if self.tokens:  # generated while the round trip was in flight
            self.since = submitted


class Segment(NamedTuple):
    """An environment segment to log: the observation's tokens (rendered once), its text, its turn."""

    tokens: list[int]
    observation: str | None
    turn: int


class Pending(NamedTuple):
    """One flush in a batch: the sample, how many of its buffered tokens, its finish reason; or
    its environment `segment`."""

    held: Held
    count: int
    finish: str | None
    segment: Segment | None = None


def due(held: Iterable[Held], now: float, flush_tokens: int, flush_s: float, force: bool) -> list[Held]:
    """The samples to flush now: finished, a trajectory's ended turn, or with `flush_tokens`
    unflushed tokens, or whose oldest unflushed token is `flush_s` old; with `force`, every one
    with unflushed tokens."""
    return [
        h
        for h in held
        if h.finish is not None
        or (h.tokens and (force or h.turn_end is not None or len(h.tokens) >= flush_tokens or now - h.since >= flush_s))
    ]


def flushes(batch: Sequence[Pending], instance_id: str, version: int | None, weights_sha: str | None) -> list[Flush]:
    """The fenced flushes of a batch, each from where the sample's logged tokens end (an
    environment segment's: logprobs 0.0, no version; a model one's: the sha of the weights that
    generated it)."""
    return [
        Flush(
            h.sample_id,
            instance_id,
            h.epoch,
            segment.tokens,
            [0.0] * len(segment.tokens),
            h.logged,
            source="env",
            observation=segment.observation,
            turn=segment.turn,
            env_s=h.env_s,
            wait_s=h.wait_s,
        )
        if segment is not None
        else Flush(
            h.sample_id,
            instance_id,
            h.epoch,
            h.tokens[:count],
            h.logprobs[:count],
            h.logged,
            finish,
            version,
            outcome=h.outcome if finish is not None else None,
            env_s=h.env_s if finish is not None else 0.0,
            wait_s=h.wait_s if finish is not None else 0.0,
            weights_sha=weights_sha,
        )
        for h, count, finish, segment in batch
    ]
