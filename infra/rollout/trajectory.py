"""Multi-turn trajectories in a rollout worker (docs/internals.md §4, "Trajectories"): each one's
environment state (`Episode`) and the thread pool its environment runs on (`Trajectories`).

When the engine ends one of a trajectory's model turns, the worker flushes the turn, then
`Trajectories.submit` decodes only that turn and runs `env.step` on the pool: the engine keeps
decoding the other samples, it never waits on a tool. The worker collects the answers (`settled`):
an observation becomes an environment segment, rendered once (`observation_tokens`); done ends
the trajectory. The environment is built on the first step on this instance: `reset`, then
`replay` of the completed turns logged before (a trajectory migrated mid-trajectory), so a turn
logged without its result is stepped again with the same `StepKey`. A step that raises, runs past
its timeout or finds its environment gone is an `InfraFailure`, never an observation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from infra.rollout.tokenlog import Claim, EnvironmentSpec, LoggedTurn, turn_starts
from rl.environments.protocol import Environment, EnvironmentGone, StepKey, StepResult, ToolEnvironment
from rl.environments.registry import EnvironmentFactory
from rl.environments.tool_calls import ToolFormat, make_tool_format

log = logging.getLogger("rlboost.worker")


@dataclass(frozen=True)
class InfraFailure:
    """An environment call that failed for the infrastructure (`INFRA_FAILURE_KINDS`)."""

    kind: str
    """``env_error`` (it raised), ``env_timeout`` (past `step_timeout_s`) or ``env_gone``."""
    error: str


@dataclass(eq=False)
class Episode:
    """One held trajectory's environment state on this instance."""

    sample_id: str
    spec: EnvironmentSpec
    factory: EnvironmentFactory
    turns: list[LoggedTurn]
    """Completed turns (each followed by its logged environment segment)."""
    starts: list[int]
    """Where each model turn starts in the response, the current one's last."""
    failures: int = 0
    """Infrastructure failures retried so far (from scratch by earlier owners, then here)."""
    env: Environment | None = None
    """Built on the first step here (reset, then the logged turns replayed)."""
    job: Future[StepResult] | None = None
    """The step in flight on the pool."""
    started: list[float] = field(default_factory=list)
    """When the job began running (set by the pool's thread); empty while it waits for a thread."""
    timeout_s: float = 0.0
    appending: bool = False
    """Its observation's env flush is in flight."""
    step_s: float = 0.0
    """Seconds the last step took (building the environment, replaying, stepping)."""

    @property
    def turn(self) -> int:
        """The 0-based model turn being generated or answered."""
        return len(self.turns)

    @property
    def replayable(self) -> bool:
        return self.factory.replayable


def _classify(error: BaseException) -> str:
    return "env_gone" if isinstance(error, EnvironmentGone) else "env_error"


class Trajectories:
    """The environments of one worker's trajectories, and the pool their calls run on."""

    def __init__(self, tokenizer: Any, threads: int) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="env-step")
        self._formats: dict[bool, ToolFormat] = {}

    def begin(self, claim: Claim) -> Episode | None:
        """The episode of a claimed trajectory (None: a single-turn sample)."""
        spec = claim.environment
        if spec is None:
            return None
        if self.tokenizer is None:
            raise ValueError("a trajectory needs the worker engine's tokenizer")
        factory = EnvironmentFactory(spec.path, dict(spec.args))
        starts = turn_starts(claim.turns, claim.version_spans, len(claim.generated_ids))
        return Episode(claim.sample_id, spec, factory, list(claim.turns), starts, failures=claim.env_retries)

    def format(self, spec: EnvironmentSpec) -> ToolFormat:
        """The tool-call format of `spec` (made once per worker: a chat template is probed)."""
        if spec.chat_template not in self._formats:
            self._formats[spec.chat_template] = make_tool_format(spec.chat_template, self.tokenizer)
        return self._formats[spec.chat_template]

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def submit(self, episode: Episode, response: list[int]) -> None:
        """Step the environment with the current model turn of `response` (decoded alone), after
        building it if needed (reset, then each logged turn replayed, decoded from `response`)."""
        replay: list[tuple[str, str | None]] = []
        if episode.env is None:
            for start, turn in zip(episode.starts, episode.turns):
                replay.append((self._decode(response[start : turn.end]), turn.observation))
        text = self._decode(response[episode.starts[-1] :])
        key = StepKey(episode.sample_id, episode.turn)
        episode.started = []
        episode.timeout_s = episode.spec.step_timeout_s * (1 + len(replay))
        episode.job = self._pool.submit(self._step, episode, replay, text, key)

    def _step(self, episode: Episode, replay: list[tuple[str, str | None]], text: str, key: StepKey) -> StepResult:
        # Importing the environment's module (once per process: a library such as verifiers takes
        # seconds) and probing a chat template are not the step's: its timeout starts after them.
        tool_format = self.format(episode.spec) if episode.factory.uses_tools else None
        started = time.monotonic()
        episode.started.append(started)
        if episode.env is None:
            env = episode.factory.create(tool_format)
            env.reset(episode.spec.prompt, episode.spec.answer, None)
            for turn, (turn_text, observation) in enumerate(replay):
                env.replay(turn_text, observation, StepKey(episode.sample_id, turn))
            episode.env = env
        result = episode.env.step(text, key)
        episode.step_s = time.monotonic() - started
        return result

    def settled(self, episodes: Iterable[Episode], now: float) -> list[tuple[Episode, StepResult | InfraFailure]]:
        """The episodes whose step finished, or ran past its timeout, with the result (the job is
        cleared; a timed-out environment is abandoned to its thread, never used again)."""
        done: list[tuple[Episode, StepResult | InfraFailure]] = []
        for episode in episodes:
            job = episode.job
            if job is None:
                continue
            if job.done():
                episode.job = None
                error = job.exception()
                if error is None:
                    done.append((episode, job.result()))
                else:
                    log.warning("sample %s: environment step failed: %r", episode.sample_id, error)
                    done.append((episode, InfraFailure(_classify(error), repr(error))))
            elif episode.started and now - episode.started[0] > episode.timeout_s:
                episode.job, episode.env = None, None  # its thread may run on: never touched again
                log.warning("sample %s: environment step past %.1f s", episode.sample_id, episode.timeout_s)
                done.append((episode, InfraFailure("env_timeout", f"past {episode.timeout_s:g} s")))
        return done

    def observation_tokens(self, episode: Episode, observation: str | None) -> list[int]:
        """The tokens of the environment segment carrying `observation` (rendered once: a tool
        environment's format renders it; another's text is encoded as it is)."""
        if isinstance(episode.env, ToolEnvironment):
            return episode.env.format.encode(observation or "", self.tokenizer)
        return list(self.tokenizer.encode(observation or "", add_special_tokens=False))

    def discard(self, episode: Episode) -> None:
        """Forget the episode's environment and its job: closed on the pool (after the job ends,
        if one runs; a timed-out one is never closed, it may still be in use)."""
        env, job = episode.env, episode.job
        episode.env, episode.job = None, None
        if env is None:
            return
        if job is None:
            self._pool.submit(_close, env, episode.sample_id)
        else:
            job.add_done_callback(lambda _: _close(env, episode.sample_id))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _close(env: Environment, sample_id: str) -> None:
    try:
        env.close()
    except Exception:
        log.warning("sample %s: closing its environment failed", sample_id, exc_info=True)
