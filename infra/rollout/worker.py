"""The rollout worker (docs/internals.md §3-4): one rollout instance's loop of claim -> generate ->
flush against the run's token log, its control messages, heartbeats and drain.

A `RolloutWorker` owns a `GenerationEngine` and the samples it holds (`infra.rollout.held`). It
follows the current step (`infra.rollout.protocol`), loads the version the step needs
(`infra.rollout.weight_source`), claims up to its free slots and flushes each sample's new tokens
every `flush_tokens` tokens or `flush_ms`, pipelined (`infra.rollout.flush_pipeline`); a rejected
flush means the lease was revoked. Its `WorkerMode` says whether it generates, is released
(``release_all``), asleep or waking. SIGTERM, a ``drain`` message or eviction stops it: it flushes,
hands every sample back, deregisters and exits 0. Its configuration and command line are
`infra.rollout.worker_config`'s; `main(argv)` is the process entry point (``rlboost worker``).
A multi-turn trajectory ends a model turn, not its sample: its environment answers on a thread
pool (`infra.rollout.trajectory`) while the engine decodes the others, and the answer is logged as
an environment segment before the next turn starts from the logged tokens. A ``release_all``
hands a trajectory in a tool call back once its answer is logged (its call is not cut off).
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_for_any
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from infra.rollout import held as held_samples
from infra.rollout import worker_engine
from infra.rollout.control import ROUTE_S, ControlMessage, Drain, Release, ReleaseAll, Resume, Unknown
from infra.rollout.direct_weights import DirectWeights
from infra.rollout.flush_pipeline import FlushPipeline
from infra.rollout.held import Held, Pending, Segment
from infra.rollout.protocol import StepWindow, current_window
from infra.rollout.registry import InstanceRegistry
from infra.rollout.tokenlog import INFRA_FAILED, Claim, LoggedTurn, Outcome, TokenLog
from infra.rollout.trajectory import InfraFailure, Trajectories
from infra.rollout.weight_source import HandedOverWeights, PulledWeights, WeightSource
from infra.rollout.worker_config import TORCH_THREADS, WorkerConfig, parse_config
from infra.services.redis_embedded import RedisSettings
from infra.weights.manifest import fingerprint
from infra.weights.puller import AdapterBaseMismatch
from rl.driver_watch import watch_driver
from rl.environments.protocol import StepResult
from rl.generation import FINISH_LENGTH, GenerationEngine, TokenChunk

__all__ = ["RECONCILE_S", "STEAL_HOLDOFF_S", "TORCH_THREADS", "RolloutWorker", "WorkerConfig", "WorkerMode", "main"]

log = logging.getLogger("rlboost.worker")

RECONCILE_S = 5.0
"""Seconds between two checks that the token log's samples of this instance are the ones it holds."""

STEAL_HOLDOFF_S = 0.5
"""After handing back samples on a `release` request (a steal), claiming pauses this long so the
idle instance the controller is balancing toward gets them first."""

# --- the worker ----------------------------------------------------------------------------------


class WorkerMode(enum.Enum):
    """What the engine and the claims do (docs/ARCHITECTURE.md, the life of a rollout instance). A
    stop is apart: any thread or a signal may request it (`request_stop`), and it is never undone."""

    GENERATING = "generating"
    """Awake; claims whenever its version is in the step window."""
    RELEASED = "released"
    """Told ``release_all`` for a step: claims none of it (another step ends the pause); awake."""
    ASLEEP = "asleep"
    """Released and idle: the engine sleeps (its device memory is the trainer's)."""
    WAKING = "waking"
    """The release ended (``resume``, another step) while asleep: woken at the next claim or load."""


@dataclass
class WorkerStats:
    claimed: int = 0
    """Samples leased."""
    resumed: int = 0
    """Of those, samples that came with logged tokens (migrated)."""
    finished: int = 0
    """Samples completed (finishing flush accepted)."""
    released: int = 0
    """Samples handed back (fenced release accepted)."""
    dropped: int = 0
    """Samples dropped because a flush or release was rejected (lease revoked)."""
    failed: int = 0
    """Samples the engine refused (marked failed)."""
    disowned: int = 0
    """Samples the token log had as running here that this worker did not hold (handed back)."""
    tokens: int = 0
    """Tokens generated."""
    flushes: int = 0
    """Flush round trips."""
    weight_loads: int = 0
    sleeps: int = 0
    """Times the engine was put to sleep after a `release_all`."""
    generating_s: float = 0.0
    """Seconds spent in engine steps (generating)."""
    env_steps: int = 0
    """Environment calls of trajectories' turns (retries included)."""
    env_retries: int = 0
    """Infrastructure failures of environments retried."""
    infra_failed: int = 0
    """Trajectories failed for the infrastructure after their retries (``infra:<kind>``)."""


class RolloutWorker:
    """A rollout instance: `run()` until SIGTERM, a drain request or eviction."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        client: redis.Redis | None = None,
        engine: GenerationEngine | None = None,
        weights: DirectWeights | None = None,
        tokenizer: Any = None,
    ) -> None:
        """`client` (binary responses) and `engine` are made from the config when not given.
        `weights`: the trainer's versions, handed over in this process, loaded instead of pulled.
        `tokenizer`: the engine's model's (trajectories decode their turns and encode observations
        with it; default: the engine's own, a `rl.stops.StopStrings` has one)."""
        self.config = config
        ca_file = None if config.redis_ca_file is None else Path(config.redis_ca_file)
        self.client = client or RedisSettings(url=config.redis_url, ca_file=ca_file).client()
        self.tokenlog = TokenLog(self.client, config.run_id)
        self._flusher = FlushPipeline(self.tokenlog)
        self._weights: WeightSource = (
            PulledWeights(self.client, config.run_id, config.instance.instance_id)
            if weights is None
            else HandedOverWeights(weights)
        )
        self.registry = InstanceRegistry(self.client, config.run_id)
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self._trajectories: Trajectories | None = None
        """The environments of the trajectories held (made at the first one)."""
        self._mode = WorkerMode.GENERATING
        self.failure: BaseException | None = None
        """The exception that ended `run()` with exit code 1, if one did."""
        self.stats = WorkerStats()
        self.held: dict[str, Held] = {}
        self.awaiting: frozenset[str] = frozenset()
        """Trajectories whose turn ended, waiting for their environment's answer (the heartbeat
        reports them: the steal policy leaves them where they are); set by the main loop only."""
        self._release_when_answered: set[str] = set()
        """Trajectories a ``release_all`` found in a tool call: each is handed back once its answer
        is logged (the call is not cut off to be made again; the receiver continues from the answer)."""
        self._answered_to_release: list[Held] = []
        """Those whose answer is now logged: the main loop releases them."""
        self._poll_s = config.poll_ms / 1000
        self._flush_s = config.flush_ms / 1000
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._hb_stop = threading.Event()
        self._step: StepWindow | None = None
        self._paused_step: int | None = None
        """The step a ``release_all`` paused (None unless `RELEASED` or `ASLEEP`)."""
        self._claim_after = 0.0
        self._next_reconcile = time.monotonic() + RECONCILE_S
        self._next_poll = 0.0
        self._claims = 0
        self.weights_sha: str | None = None
        """The sha of the weights the engine decodes with (`fingerprint` of the state it loaded last,
        after loading; None on the base model it started with): heartbeats, claims and flushes carry it."""

    # -- lifecycle ------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Stop claiming; `run()` then hands everything back and returns. Signal-safe."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stop.set()

    @property
    def mode(self) -> WorkerMode:
        return self._mode

    @property
    def stop_reason(self) -> str | None:
        """Why the worker was told to stop (a signal's name, `drain`, `evicted`, ...), None if it was not."""
        return self._stop_reason

    def install_signal_handlers(self) -> None:
        """SIGTERM (the preemption notice) and SIGINT stop the worker gracefully."""

        def handler(signum: int, _frame: Any) -> None:
            self.request_stop(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def load_engine(self) -> GenerationEngine:
        """The configured engine on the base model (`infra.rollout.worker_engine`)."""
        self.engine = worker_engine.load_engine(self.config, self.client)
        self.tokenizer = getattr(self.engine, "tokenizer", None)
        if isinstance(self._weights, PulledWeights):
            self._weights.adapter_base = worker_engine.adapter_base(self.config, self.client)
        return self.engine

    def run(self) -> int:
        """Register, work until stopped, hand everything back, deregister. Returns the exit code
        (0 after a graceful stop, 2 when a version was made for another base model than its own,
        1 after any other error)."""
        cfg = self.config
        if self.engine is None:
            try:
                self.load_engine()
            except Exception as exc:  # its last log line is what the run reports (`PoolFailure`)
                self.failure = exc
                log.exception("loading the engine failed")
                log.error(
                    "worker %s cannot start: its %s engine on model %s failed: %s: %s",
                    cfg.instance.instance_id,
                    cfg.engine.kind,
                    cfg.model_path,
                    type(exc).__name__,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                )
                return 1
        if self._stop.is_set():  # told to stop while loading: never registered, nothing held
            log.info("worker %s stopped (%s) before registering", cfg.instance.instance_id, self._stop_reason)
            return 0
        self.registry.register(cfg.instance, cfg.slots, cfg.ttl_s)
        beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        log.info(
            "worker %s registered (pool %s, %s, %d slots)",
            cfg.instance.instance_id,
            cfg.instance.pool,
            cfg.instance.capacity_class,
            cfg.slots,
        )
        code = 0
        try:
            self._loop()
            self._hand_back_everything()
        except Exception as exc:
            code = 1
            self.failure = exc
            if isinstance(exc, AdapterBaseMismatch):  # the instance's setup is wrong, not the run: one line
                code = 2
                log.debug("the refused version", exc_info=True)
                log.error("worker %s: %s", cfg.instance.instance_id, exc)
            else:
                log.exception("worker %s failed; handing its samples back", cfg.instance.instance_id)
            try:
                self._hand_back_everything()
            except Exception:
                log.exception("hand-back after the failure failed too (the controller will reap)")
        finally:
            self._hb_stop.set()
            beat.join()
            self._flusher.close()
            self._weights.close()
            if self._trajectories is not None:
                self._trajectories.shutdown()
            try:
                self.registry.deregister(cfg.instance.instance_id)
            except redis.RedisError:
                log.warning("could not deregister %s (the controller will reap it)", cfg.instance.instance_id)
            log.info(
                "worker %s exit (%s): %s",
                cfg.instance.instance_id,
                self._stop_reason or "error",
                json.dumps(asdict(self.stats)),
            )
        return code

    # -- the loop -------------------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        assert engine is not None
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= self._next_poll:
                    self._poll()
                    self._next_poll = time.monotonic() + self._poll_s
                    if self._stop.is_set():
                        break
                self._maybe_claim()
                if engine.has_work():
                    started = time.perf_counter()
                    chunks = engine.step()
                    self.stats.generating_s += time.perf_counter() - started
                    self._absorb(chunks)
                    self._flush(force=False)  # its round trip overlaps the next engine step
                else:
                    self._flush(force=True, wait=True)
                    self._sleep_if_released()
                    self._idle()
                self._advance_trajectories()
                if self._answered_to_release:
                    answered, self._answered_to_release = self._answered_to_release, []
                    self._release(answered)
                self.awaiting = frozenset(
                    h.sample_id
                    for h in self.held.values()
                    if h.episode is not None and h.turn_end is not None and h.finish is None
                )
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Buffers are kept; flushes carry offsets, so retrying them later is exactly-once.
                log.warning("Redis unavailable (%s); retrying in %.0f ms", exc, self.config.poll_ms)
                time.sleep(self._poll_s)

    def _idle(self) -> None:
        """Nothing to generate: block on the control list until the next poll is due (on the
        trajectories' environment calls instead, while some run)."""
        wait = self._next_poll - time.monotonic()
        if self._can_claim():
            wait = min(wait, self._claim_after - time.monotonic())
        if wait <= 0.001:
            return
        jobs = [h.episode.job for h in self.held.values() if h.episode is not None and h.episode.job is not None]
        if jobs:
            wait_for_any(jobs, timeout=min(wait, self._poll_s), return_when=FIRST_COMPLETED)
            return
        message = self.registry.wait_request(self.config.instance.instance_id, min(wait, self._poll_s))
        if message is not None:
            self._control(message)
            self._next_poll = 0.0  # take any further messages now

    def _poll(self) -> None:
        """Read the current step, then control messages; load the step's version if due."""
        step = current_window(self.client, self.config.run_id)
        if step != self._step:
            if step is not None and (
                self._step is None or (step.step, step.first) != (self._step.step, self._step.first)
            ):
                if self._paused_step != step.first:
                    self._unpause()  # a new step ends a release_all pause for another
                log.info(
                    "steps %d..%d (policy version %d, staleness %d)",
                    step.first,
                    step.step,
                    step.version,
                    step.staleness,
                )
            self._step = step
            self._claim_after = 0.0
        for message in self.registry.poll_requests(self.config.instance.instance_id):
            self._control(message)
        self._maybe_load_weights()
        if time.monotonic() >= self._next_reconcile:
            self._reconcile()

    def _reconcile(self) -> None:
        """Hand back every sample the token log has as running here that this worker does not hold."""
        self._flusher.settle()  # no flush in flight: `held` is exactly what this worker holds
        disowned = self.tokenlog.disown(self.config.instance.instance_id, self.held)
        self._next_reconcile = time.monotonic() + RECONCILE_S
        if disowned:
            self.stats.disowned += disowned
            log.warning("handed back %d samples the token log had as running here (lost writes?)", disowned)

    def _pause(self, step: int | None) -> None:
        """``release_all`` for `step` (None: for no step, a pause that never holds)."""
        if step is None:
            self._unpause()
            return
        self._paused_step = step
        asleep = self._mode in (WorkerMode.ASLEEP, WorkerMode.WAKING)
        self._mode = WorkerMode.ASLEEP if asleep else WorkerMode.RELEASED

    def _unpause(self) -> None:
        """The ``release_all`` pause ends (``resume``, or a step it was not for)."""
        self._paused_step = None
        self._release_when_answered.clear()  # those still in a tool call continue here
        if self._mode is WorkerMode.RELEASED:
            self._mode = WorkerMode.GENERATING
        elif self._mode is WorkerMode.ASLEEP:
            self._mode = WorkerMode.WAKING

    def _sleep_if_released(self) -> None:
        """Put the engine to sleep once `release_all` paused the current step and it is idle."""
        engine = self.engine
        assert engine is not None
        paused = self._step is not None and self._paused_step == self._step.first
        if not paused or self._mode is not WorkerMode.RELEASED or self.held or engine.has_work():
            return
        engine.sleep()
        self._mode = WorkerMode.ASLEEP
        self.stats.sleeps += 1
        log.info("engine asleep (released step %d to the other instances)", self._paused_step)

    def _wake(self) -> None:
        if self._mode in (WorkerMode.ASLEEP, WorkerMode.WAKING):
            assert self.engine is not None
            self.engine.wake()
            self._mode = WorkerMode.RELEASED if self._mode is WorkerMode.ASLEEP else WorkerMode.GENERATING
            log.info("engine awake")

    def _maybe_load_weights(self) -> None:
        """Load the version the engine should hold when it holds another (from `self._weights`).
        Strictly on-policy that is the current step's version, loaded when no sample runs; with
        bounded staleness it is the newest version published, loaded between flushes: the running
        samples continue on it (`_reload`)."""
        engine = self.engine
        assert engine is not None
        if self._step is None or self._stop.is_set():
            return
        if self._step.strict:
            version = self._step.version
            if self.held or engine.policy_version == version:
                return
        else:
            newest = self._weights.newest()
            if newest is None or (engine.policy_version is not None and newest <= engine.policy_version):
                return
            version = newest
        state = self._weights.fetch(version)
        if state is not None:
            self._reload(state, version)
            self._weights.loaded(version)

    def _reload(self, state: Mapping[str, Any], version: int) -> None:
        """Load `state` as `version`; samples in progress are flushed first and continue on the
        new weights from their logged tokens (re-prefilled: partial rollout), keeping their leases."""
        engine = self.engine
        assert engine is not None
        running: list[Held] = []
        if self.held:
            self._flush(force=True, wait=True)  # every buffered token is logged under the old version
            running = [h for h in self.held.values() if h.finish is None and h.turn_end is None]
            for held in running:
                self._engine_release(held.sample_id)
        self._wake()
        engine.load_weights(state, version)
        self.weights_sha = fingerprint(state)
        for held in running:
            if self.held.get(held.sample_id) is held:
                engine.add(held.request())
        self.stats.weight_loads += 1
        self._claim_after = 0.0

    def _can_claim(self) -> bool:
        if self._stop.is_set() or self._step is None or self.engine is None:
            return False
        window, held_version = self._step, self.engine.policy_version
        in_window = held_version == window.version if window.strict else held_version is not None
        return self._paused_step != window.first and in_window and len(self.held) < self.config.slots

    def _maybe_claim(self) -> None:
        if not self._can_claim() or time.monotonic() < self._claim_after:
            return
        assert self._step is not None and self.engine is not None
        self._wake()
        free = self.config.slots - len(self.held)
        version = self.engine.policy_version
        claims = self.tokenlog.claim(
            self._step.steps, self.config.instance.instance_id, version, free, weights_sha=self.weights_sha
        )
        if len(claims) < free:  # the queue ran dry: look again at the next poll
            self._claim_after = time.monotonic() + self._poll_s
        for claim in claims:
            self._start(claim)

    def _start(self, claim: Claim) -> None:
        engine = self.engine
        assert engine is not None
        stale = self.held.pop(claim.sample_id, None)
        if stale is not None:  # we were reaped and re-claimed it before a flush told us
            self._engine_release(stale.sample_id)
        episode = self._runner().begin(claim) if claim.environment is not None else None
        stateless = episode is not None and claim.turns and not episode.replayable
        if claim.generated_ids and (self.config.restart_from_scratch or stateless):
            # The baseline does not resume, and an environment that cannot replay its logged turns
            # restarts its trajectory: drop the logged tokens; the sample is queued again empty
            # and claimed later from scratch.
            self.tokenlog.release(claim.sample_id, self.config.instance.instance_id, claim.epoch, keep_tokens=False)
            self._claim_after = 0.0
            return
        try:
            engine.add(claim.request())
        except ValueError as exc:
            log.error("sample %s cannot be generated (%s): failing it", claim.sample_id, exc)
            self.tokenlog.fail(claim.sample_id, self.config.instance.instance_id, claim.epoch, f"engine: {exc}")
            self.stats.failed += 1
            return
        self._claims += 1
        self.held[claim.sample_id] = Held(
            claim.sample_id,
            claim.epoch,
            len(claim.generated_ids),
            self._claims,
            claim,
            list(claim.generated_ids),
            episode=episode,
            turn_start=claim.turn_start,
        )
        self.stats.claimed += 1
        self.stats.resumed += bool(claim.generated_ids)

    def _absorb(self, chunks: list[TokenChunk]) -> None:
        now = time.monotonic()
        for chunk in chunks:
            held = self.held.get(chunk.sample_id)
            if held is not None:
                self.stats.tokens += held.absorb(chunk, now)

    def _flush(self, force: bool, only: list[Held] | None = None, wait: bool = False) -> None:
        """Submit one round trip for every due flush (all of `only`'s pending tokens if given)
        to the flush pipeline, after settling the one in flight; `wait` settles this one too."""
        self._flusher.settle()
        if only is not None:
            due = [h for h in only if self.held.get(h.sample_id) is h and (h.tokens or h.finish)]
        else:
            due = held_samples.due(self.held.values(), time.monotonic(), self.config.flush_tokens, self._flush_s, force)
        segments = [
            h for h in (only or self.held.values()) if h.segment is not None and self.held.get(h.sample_id) is h
        ]
        if due or segments:
            assert self.engine is not None
            batch = [Pending(h, len(h.tokens), h.finish) for h in due]
            batch += [Pending(h, len(h.segment.tokens), None, h.segment) for h in segments if h.segment is not None]
            # With bounded staleness each flush names the version that generated it (all of its
            # tokens: a new version is loaded only after a forced flush); strictly on-policy the
            # claim's fence already made it the step's version.
            version = self.engine.policy_version if self._step is not None and not self._step.strict else None
            flushes = held_samples.flushes(batch, self.config.instance.instance_id, version, self.weights_sha)
            self._flusher.submit(flushes, functools.partial(self._flushed, batch, time.monotonic()))
            self.stats.flushes += 1
        if wait:
            self._flusher.settle()

    def _flushed(self, batch: list[Pending], submitted: float, results: list[bool]) -> None:
        """Apply a settled batch: accepted tokens become logged, a rejection drops the sample."""
        for (held, count, finish, segment), ok in zip(batch, results):
            if self.held.get(held.sample_id) is not held:
                continue  # re-claimed under a new lease meanwhile: this flush was fenced off
            if not ok:
                self._drop(held, "flush rejected")
                continue
            if segment is not None:
                self._next_turn(held, segment)
                continue
            held.logged_ok(count, submitted)
            if finish is not None:
                del self.held[held.sample_id]
                self._close_episode(held)
                self.stats.finished += 1

    def _drop(self, held: Held, why: str) -> None:
        """The lease was revoked (reaped or stolen): forget the sample, write nothing more."""
        if self.held.get(held.sample_id) is held:
            del self.held[held.sample_id]
        self._engine_release(held.sample_id)
        self._close_episode(held)
        self.stats.dropped += 1
        log.info("dropped sample %s (%s: lease revoked)", held.sample_id, why)

    def _engine_release(self, sample_id: str) -> None:
        assert self.engine is not None
        try:
            self.engine.release(sample_id)
        except KeyError:
            pass  # it had finished in the engine already

    # -- trajectories: the environment's turns -----------------------------------------------------

    def _runner(self) -> Trajectories:
        if self._trajectories is None:
            self._trajectories = Trajectories(self.tokenizer, threads=max(2, self.config.slots))
        return self._trajectories

    def _advance_trajectories(self) -> None:
        """Step the environment of each trajectory whose turn ended and is logged; apply the
        answers that came back (or the failures)."""
        waiting = [h for h in self.held.values() if h.episode is not None and h.finish is None]
        if not waiting:
            return
        runner = self._runner()
        for held in waiting:
            episode = held.episode
            assert episode is not None
            if held.turn_end is None or held.tokens or held.segment is not None or episode.job is not None:
                continue
            if held.turn_end == FINISH_LENGTH:  # the budget ended the turn: nothing left to answer
                self._end_trajectory(held, Outcome(None, truncated=True))
            else:
                runner.submit(episode, held.prefix)
                self.stats.env_steps += 1
        holders = {id(h.episode): h for h in waiting}
        for episode, result in runner.settled([h.episode for h in waiting if h.episode is not None], time.monotonic()):
            held = holders[id(episode)]
            if self.held.get(held.sample_id) is not held:
                continue
            if isinstance(result, InfraFailure):
                self._env_failed(held, result)
            else:
                self._answered(held, result)

    def _answered(self, held: Held, result: StepResult) -> None:
        """The environment answered the turn: the trajectory ends (done, or a limit: truncated), or
        its observation is logged as an environment segment before the next turn (`_next_turn`)."""
        episode = held.episode
        assert episode is not None
        held.env_s, held.wait_s = episode.step_s, time.monotonic() - held.turn_ended_at
        if result.done:
            self._end_trajectory(held, Outcome(result.reward, result.truncated))
            return
        if episode.turn + 1 >= episode.spec.max_turns:
            self._end_trajectory(held, Outcome(None, truncated=True))
            return
        tokens = self._runner().observation_tokens(episode, result.observation)
        if held.logged + len(tokens) >= held.claim.max_new_tokens:  # no room left for a model token
            self._end_trajectory(held, Outcome(None, truncated=True), FINISH_LENGTH)
            return
        held.segment = Segment(tokens, result.observation, episode.turn)

    def _end_trajectory(self, held: Held, outcome: Outcome, reason: str | None = None) -> None:
        """Finish the trajectory (its finishing flush goes with the next batch)."""
        held.finish = reason or held.turn_end
        held.outcome = outcome
        self._close_episode(held)

    def _next_turn(self, held: Held, segment: Segment) -> None:
        """The observation is logged: the next model turn continues from the logged tokens."""
        episode = held.episode
        assert episode is not None and self.engine is not None
        held.segment, held.env_s, held.wait_s = None, 0.0, 0.0
        episode.turns.append(LoggedTurn(held.logged, segment.observation))
        held.logged += len(segment.tokens)
        held.prefix += segment.tokens
        episode.starts.append(held.logged)
        held.turn_start, held.turn_end = held.logged, None
        if held.sample_id in self._release_when_answered:
            self._release_when_answered.discard(held.sample_id)
            self._answered_to_release.append(held)  # released by the main loop, not in this callback
            return
        self.engine.add(held.request())

    def _env_failed(self, held: Held, failure: InfraFailure) -> None:
        """An infrastructure failure: retried (the environment is built again from the logged turns
        and steps the turn with the same key; one that cannot replay restarts the trajectory from
        scratch), or, after `retries`, the sample fails (``infra:<kind>``), never scored."""
        episode = held.episode
        assert episode is not None
        episode.failures += 1
        self._runner().discard(episode)
        instance = self.config.instance.instance_id
        log.warning("sample %s: %s (%s), failure %d", held.sample_id, failure.kind, failure.error, episode.failures)
        if episode.failures <= episode.spec.retries:
            self.stats.env_retries += 1
            if episode.replayable or not episode.turns:
                return  # stepped again by the next `_advance_trajectories`
            del self.held[held.sample_id]
            self.tokenlog.release(held.sample_id, instance, held.epoch, keep_tokens=False, env_retry=True)
            return
        del self.held[held.sample_id]
        self.stats.infra_failed += 1
        self.tokenlog.fail(held.sample_id, instance, held.epoch, f"{INFRA_FAILED}{failure.kind}")

    def _close_episode(self, held: Held) -> None:
        if held.episode is not None and self._trajectories is not None:
            self._trajectories.discard(held.episode)

    # -- handing samples back -------------------------------------------------------------------

    def _release(self, samples: list[Held], to: str | None = None, route_s: float = ROUTE_S) -> None:
        """Stop generating `samples`, flush their tails, then release them (fenced; routed to
        instance `to` for `route_s` if given)."""
        samples = [h for h in samples if self.held.get(h.sample_id) is h]
        if not samples:
            return
        self._flush(force=True, only=samples, wait=True)  # finished ones complete, not migrate
        instance = self.config.instance.instance_id
        for held in samples:
            if self.held.get(held.sample_id) is not held:
                continue  # finished, or dropped by the flush
            self._engine_release(held.sample_id)
            self._close_episode(held)
            del self.held[held.sample_id]
            keep = not self.config.restart_from_scratch
            if self.tokenlog.release(held.sample_id, instance, held.epoch, keep_tokens=keep, to=to, route_s=route_s):
                self.stats.released += 1
            else:
                self.stats.dropped += 1
                log.info("dropped sample %s (release rejected: lease revoked)", held.sample_id)

    def _hand_back_everything(self) -> None:
        """Flush and release every held sample, then sweep anything the log says we still own
        (e.g. a claim whose reply was lost)."""
        self._release(list(self.held.values()))
        swept = self.tokenlog.release_all(self.config.instance.instance_id)
        if swept:
            log.warning("released %d samples this worker did not know it owned", swept)

    # -- control messages -----------------------------------------------------------------------

    def _control(self, message: ControlMessage | Unknown) -> None:
        match message:
            case Release(sample_ids=ids, count=count, to=to, route_s=route_s):
                if ids is not None:
                    targets = [self.held[s] for s in ids if s in self.held]
                else:
                    running = [h for h in self.held.values() if h.finish is None]
                    running.sort(key=lambda h: (h.generated, -h.order))  # the most work left first
                    targets = running[: max(count, 0)]
                self._claim_after = time.monotonic() + STEAL_HOLDOFF_S
                log.info("releasing %d samples on request%s", len(targets), f" to {to}" if to else "")
                self._release(targets, to=to or None, route_s=route_s)
            case ReleaseAll(step=step):
                step = step if step is not None else (self._step.first if self._step else None)
                self._pause(step)
                in_call: set[str] = set()
                if self._paused_step is not None:  # a pause holds: a trajectory in a tool call waits for its answer
                    in_call = {
                        h.sample_id for h in self.held.values() if h.episode is not None and h.episode.job is not None
                    }
                self._release_when_answered = in_call
                log.info(
                    "releasing all %d samples (%d after their tool call); not claiming for step %s",
                    len(self.held),
                    len(in_call),
                    step,
                )
                self._release([h for h in self.held.values() if h.sample_id not in in_call])
            case Resume():
                self._unpause()
                self._claim_after = 0.0
            case Drain():
                self.request_stop("drain")
            case Unknown(text=text):
                log.warning("ignoring unknown control message %r", text)

    # -- heartbeats -----------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self.config.heartbeat_s):
            self.heartbeat()

    def heartbeat(self) -> bool:
        """Report version, free slots (0 while not claiming) and running samples; a False reply
        (deregistered: evicted) stops the worker."""
        engine = self.engine
        paused = self._stop.is_set() or (self._step is not None and self._paused_step == self._step.first)
        running = len(self.held)
        free = 0 if paused else max(self.config.slots - running, 0)
        try:
            ok = self.registry.heartbeat(
                self.config.instance.instance_id,
                engine.policy_version if engine else None,
                free,
                running,
                self.config.ttl_s,
                self.weights_sha,
                self.awaiting,
            )
        except redis.RedisError as exc:
            log.warning("heartbeat failed: %s", exc)
            return True
        if not ok and not self._hb_stop.is_set():
            log.warning("instance %s is no longer registered (evicted): stopping", self.config.instance.instance_id)
            self.request_stop("evicted")
        return ok


# --- entry point ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run a `RolloutWorker` until it stops; returns the exit code."""
    config, args = parse_config(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import torch

    torch.set_num_threads(args.threads)
    worker = RolloutWorker(config)
    worker.install_signal_handlers()  # before the (slow) model load: a notice then stops at once
    watch_driver(lambda: worker.request_stop("driver gone"))  # no orphan when the driver is killed
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
