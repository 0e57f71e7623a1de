"""The rollout worker: one rollout instance's loop of claim -> generate -> flush (docs/internals.md §3-4).

A `RolloutWorker` owns a `GenerationEngine` (HF or vLLM, `rl.engine_spec`; wrapped in `rl.stops.StopStrings`
so the stop strings in a group's sampling end its samples) and runs it against the run's token log:

* it registers in the `InstanceRegistry` and heartbeats from a background thread (policy version
  held, free slots, running samples); a heartbeat answered False means it was evicted: it stops;
* it follows the **current step** the controller publishes (`set_current_step` / `current_step`
  below). When its engine's policy version differs from the step's and it holds no running
  sample, it pulls that version once it is announced (`infra.weights.WeightPuller`, with the
  settings the trainer shared in Redis: striped over the peers that hold it and the trainer,
  verified, store as fallback), serves it to later pullers, then claims. A worker in the training
  process (a co-located instance, `infra.run.colocated`) is given `DirectWeights` instead: it takes
  the version the trainer handed over (`infra.rollout.direct_weights`), with no pull and no
  transfer reported;
* late binding: it claims up to its free slots of the current step (partially generated samples
  first, resumed from their logged tokens by re-prefill), steps the engine, buffers each sample's
  new tokens and flushes a sample when it has `flush_tokens` unflushed tokens, its oldest
  unflushed token is `flush_ms` old, or it finished (eos / length: a fenced finishing flush). All
  due flushes of an engine step go in one round trip (`TokenLog.log`), pipelined: it runs on a
  background thread while the engine computes the next step (`infra.rollout.flush_pipeline`), and is
  settled before the next batch, a release or an idle wait. A rejected flush means the
  lease was revoked (the sample was reaped or stolen): the sample is dropped from the engine with
  no further writes;
* control messages (`InstanceRegistry.request`):
  ``{"op": "release", "sample_ids": [...]}`` or ``{"op": "release", "count": n}`` flushes, then
  hands back those samples (fenced); with a count it picks the samples with the most work left
  (fewest tokens); with ``"to": receiver`` (and ``"route_s"``) the token log routes them to that
  instance (`TokenLog.release`). Either way it pauses claiming for `STEAL_HOLDOFF_S`, so the idle
  instance the controller balances toward gets them (claims prefer partially generated samples).
  ``{"op": "release_all"[, "step": s]}`` (end of `T_local`) flushes and hands back everything and
  stops claiming for step s (default: the current step; s may be a step not started yet) until
  ``{"op": "resume"}`` or another step starts. Once released and idle it puts its engine to
  sleep (`GenerationEngine.sleep`: the device memory goes to the trainer) and wakes it before it
  next loads weights or claims.
  ``{"op": "drain"}`` is a SIGTERM;
* **SIGTERM is the preemption notice**: it stops claiming, flushes and releases every sample
  (fenced, then a sweep of anything it still owns), deregisters and exits 0 — milliseconds, well
  within any notice period. After a SIGKILL only the unflushed tail (at most `flush_tokens`
  tokens or `flush_ms` per sample) is lost; the controller reaps the rest.
* every `RECONCILE_S` it hands back what the token log says it runs and it does not hold
  (`TokenLog.disown`): a Redis restarted from an append-only file that lost its last second of
  writes remembers a finish (or a claim) the worker already had acknowledged as still running
  here, and without this the step would wait for a sample no one generates.
* `WorkerConfig.restart_from_scratch` (off by default) turns the worker into the baseline that
  never resumes a sample: its releases discard the logged tokens, and so does a claim of a sample
  that comes with logged tokens (one reaped from a dead instance), which then starts over.

The current-step protocol it follows is in `infra.rollout.protocol`.

`main(argv)` is the process entry point (``rlboost worker ...`` or ``python -m infra.rollout.worker``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
from pydantic import Field, model_validator

from infra.availability.capacity import CapacityClass
from infra.rollout.direct_weights import DirectWeights
from infra.rollout.flush_pipeline import FlushPipeline
from infra.rollout.protocol import StepWindow, current_window
from infra.rollout.registry import InstanceInfo, InstanceRegistry
from infra.rollout.settings import WorkerSettings, add_worker_flags, settings_from_flags
from infra.rollout.tokenlog import Claim, Flush, TokenLog
from infra.services.redis_embedded import REDIS_CA_FILE_ENV, RedisSettings
from infra.weights.holders import latest_version
from infra.weights.model_source import fetch_model, is_url
from infra.weights.puller import PullError, WeightPuller
from infra.weights.shared import report_transfer, shared_config
from rl.driver_watch import watch_driver
from rl.engine_spec import EngineSpec
from rl.generation import GenerationEngine

log = logging.getLogger("rlboost.worker")

RECONCILE_S = 5.0
"""Seconds between two checks that the token log's samples of this instance are the ones it holds."""

TORCH_THREADS = 1
"""Torch intra-op threads of a worker (`--threads`): a rollout engine decodes small batches, which
contended cores run faster on one thread."""

STEAL_HOLDOFF_S = 0.5
"""After handing back samples on a `release` request (a steal), claiming pauses this long so the
idle instance the controller is balancing toward gets them first."""

# --- configuration -------------------------------------------------------------------------------


class WorkerConfig(WorkerSettings):
    """One rollout instance: who it is, where its run is, and the `WorkerSettings` it runs with."""

    redis_url: str
    """URL of the run's Redis (token log, registry, control); may carry the password."""
    redis_ca_file: str | None = None
    """PEM file of the CA that signed a rediss:// Redis's certificate; None: the system's trust store."""
    run_id: str
    """The run whose steps this instance generates."""
    instance_id: str
    """Unique id of this instance (the registry key and the owner of its leases)."""
    pool: str
    """The pool the instance belongs to (provider, zone, machine type, class)."""
    capacity_class: CapacityClass = "spot"
    """reserved, ondemand or spot."""
    price_per_hour: float = Field(0.0, ge=0)
    """What the instance costs, for the controller and the ledger."""
    model_path: str
    """Base Hugging Face model: architecture, tokenizer, and the weights of version 0. A local
    directory, or an fsspec URL of a copy published by the training run (`infra.weights.model_source`;
    read with the run's weight-store options when it lies under the store), downloaded once."""
    engine: EngineSpec = EngineSpec()
    """The generation engine: backend, device, dtype (`rl.engine_spec`); an HF engine's batch
    defaults to `slots`."""
    poll_ms: float = Field(25.0, gt=0)
    """How often the current step and control messages are read; also the longest idle wait."""

    @model_validator(mode="after")
    def _run_id_is_a_hash_tag(self) -> WorkerConfig:
        if any(c in self.run_id for c in "{}") or not self.run_id:
            raise ValueError(f"run_id must be non-empty without braces: {self.run_id!r}")
        return self


# --- the worker ----------------------------------------------------------------------------------


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


@dataclass(eq=False)
class _Held:
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

    @property
    def generated(self) -> int:
        return self.logged + len(self.tokens)


class RolloutWorker:
    """A rollout instance: `run()` until SIGTERM, a drain request or eviction."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        client: redis.Redis | None = None,
        engine: GenerationEngine | None = None,
        weights: DirectWeights | None = None,
    ) -> None:
        """`client` (binary responses) and `engine` are made from the config when not given.
        `weights`: the trainer's versions, handed over in this process, loaded instead of pulled."""
        self.config = config
        self._direct_weights = weights
        self.client = client or RedisSettings(url=config.redis_url, ca_file=config.redis_ca_file).client()
        self.tokenlog = TokenLog(self.client, config.run_id)
        self._flusher = FlushPipeline(self.tokenlog)
        self._puller: WeightPuller | None = None
        self.registry = InstanceRegistry(self.client, config.run_id, ttl_s=config.ttl_s)
        self.engine = engine
        self._engine_asleep = False
        self.failure: BaseException | None = None
        """The exception that ended `run()` with exit code 1, if one did."""
        self.stats = WorkerStats()
        self.held: dict[str, _Held] = {}
        self._poll_s = config.poll_ms / 1000
        self._flush_s = config.flush_ms / 1000
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._hb_stop = threading.Event()
        self._step: StepWindow | None = None
        self._paused_step: int | None = None
        self._claim_after = 0.0
        self._next_reconcile = time.monotonic() + RECONCILE_S
        self._next_poll = 0.0
        self._claims = 0
        self._missing_version: int | None = None
        self._ctl_key = f"{self.registry.prefix}ctl:{config.instance_id}"
        """The registry's control list (documented layout), blocked on while idle."""

    # -- lifecycle ------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Stop claiming; `run()` then hands everything back and returns. Signal-safe."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stop.set()

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
        """The configured engine on the base model (its weights are version 0), applying each
        sample's stop strings (`rl.stops.StopStrings`, with the model's tokenizer)."""
        from transformers import AutoTokenizer

        from rl.engine_factory import build_engine
        from rl.stops import StopStrings

        model_dir = self._local_model()
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        engine = build_engine(
            self.config.engine,
            model_dir,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            max_batch_size=self.config.slots,
            field="engine",
        )
        log.info(
            "engine %s on %s (%s) for instance %s",
            self.config.engine.kind,
            self.config.engine.device,
            self.config.engine.dtype,
            self.config.instance_id,
        )
        self.engine = StopStrings(engine, tokenizer)
        return self.engine

    def _local_model(self) -> Path:
        """The base model's local directory, downloaded first when it is a URL."""
        location = self.config.model_path
        if not is_url(location):
            return fetch_model(location)
        settings = shared_config(self.client, self.config.run_id)
        under_store = (
            settings is not None and settings.store_url and location.startswith(settings.store_url.rstrip("/"))
        )
        return fetch_model(location, settings.store_options if under_store else None)

    def run(self) -> int:
        """Register, work until stopped, hand everything back, deregister. Returns the exit code
        (0 after a graceful stop, 1 after an error)."""
        cfg = self.config
        if self.engine is None:
            try:
                self.load_engine()
            except Exception as exc:  # its last log line is what the run reports (`PoolStartFailure`)
                self.failure = exc
                log.exception("loading the engine failed")
                log.error(
                    "worker %s cannot start: its %s engine on model %s failed: %s: %s",
                    cfg.instance_id,
                    cfg.engine.kind,
                    cfg.model_path,
                    type(exc).__name__,
                    str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                )
                return 1
        if self._stop.is_set():  # told to stop while loading: never registered, nothing held
            log.info("worker %s stopped (%s) before registering", cfg.instance_id, self._stop_reason)
            return 0
        info = InstanceInfo(cfg.instance_id, cfg.pool, cfg.capacity_class, cfg.price_per_hour, cfg.slots)
        self.registry.register(info)
        beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        log.info(
            "worker %s registered (pool %s, %s, %d slots)",
            cfg.instance_id,
            cfg.pool,
            cfg.capacity_class,
            cfg.slots,
        )
        code = 0
        try:
            self._loop()
            self._hand_back_everything()
        except Exception as exc:
            code = 1
            self.failure = exc
            log.exception("worker %s failed; handing its samples back", cfg.instance_id)
            try:
                self._hand_back_everything()
            except Exception:
                log.exception("hand-back after the failure failed too (the controller will reap)")
        finally:
            self._hb_stop.set()
            beat.join()
            self._flusher.close()
            if self._puller is not None:
                self._puller.close()
            try:
                self.registry.deregister(cfg.instance_id)
            except redis.RedisError:
                log.warning("could not deregister %s (the controller will reap it)", cfg.instance_id)
            log.info(
                "worker %s exit (%s): %s",
                cfg.instance_id,
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
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Buffers are kept; flushes carry offsets, so retrying them later is exactly-once.
                log.warning("Redis unavailable (%s); retrying in %.0f ms", exc, self.config.poll_ms)
                time.sleep(self._poll_s)

    def _idle(self) -> None:
        """Nothing to generate: block on the control list until the next poll is due."""
        wait = self._next_poll - time.monotonic()
        if self._can_claim():
            wait = min(wait, self._claim_after - time.monotonic())
        if wait <= 0.001:
            return
        reply = self.client.blpop([self._ctl_key], timeout=min(wait, self._poll_s))
        if reply is not None:
            self._control(json.loads(reply[1]))
            self._next_poll = 0.0  # take any further messages now

    def _poll(self) -> None:
        """Read the current step, then control messages; load the step's version if due."""
        step = current_window(self.client, self.config.run_id)
        if step != self._step:
            if step is not None and (
                self._step is None or (step.step, step.first) != (self._step.step, self._step.first)
            ):
                if self._paused_step != step.first:
                    self._paused_step = None  # a new step ends a release_all pause for another
                log.info(
                    "steps %d..%d (policy version %d, staleness %d)",
                    step.first,
                    step.step,
                    step.version,
                    step.staleness,
                )
            self._step = step
            self._claim_after = 0.0
        for message in self.registry.poll_requests(self.config.instance_id):
            self._control(message)
        self._maybe_load_weights()
        if time.monotonic() >= self._next_reconcile:
            self._reconcile()

    def _reconcile(self) -> None:
        """Hand back every sample the token log has as running here that this worker does not hold."""
        self._flusher.settle()  # no flush in flight: `held` is exactly what this worker holds
        disowned = self.tokenlog.disown(self.config.instance_id, self.held)
        self._next_reconcile = time.monotonic() + RECONCILE_S
        if disowned:
            self.stats.disowned += disowned
            log.warning("handed back %d samples the token log had as running here (lost writes?)", disowned)

    def _sleep_if_released(self) -> None:
        """Put the engine to sleep once `release_all` paused the current step and it is idle."""
        engine = self.engine
        assert engine is not None
        paused = self._step is not None and self._paused_step == self._step.first
        if not paused or self._engine_asleep or self.held or engine.has_work():
            return
        engine.sleep()
        self._engine_asleep = True
        self.stats.sleeps += 1
        log.info("engine asleep (released step %d to the other instances)", self._paused_step)

    def _wake(self) -> None:
        if self._engine_asleep:
            self.engine.wake()  # type: ignore[union-attr]
            self._engine_asleep = False
            log.info("engine awake")

    def _maybe_load_weights(self) -> None:
        """Load the version the engine should hold when it holds another: the one the trainer
        handed over (`DirectWeights`), else pulled once it is announced. Strictly on-policy that
        is the current step's version, loaded when no sample runs; with bounded staleness it is
        the newest version published, loaded between flushes: the running samples continue on
        it (`_reload`)."""
        engine = self.engine
        assert engine is not None
        if self._step is None or self._stop.is_set():
            return
        if self._step.staleness == 0:
            version = self._step.version
            if self.held or engine.policy_version == version:
                return
        else:
            newest = (
                self._direct_weights.version
                if self._direct_weights is not None
                else latest_version(self.client, self.config.run_id)
            )
            if newest is None or (engine.policy_version is not None and newest <= engine.policy_version):
                return
            version = newest
        if self._direct_weights is not None:
            self._load_direct(version)
        else:
            self._pull(version)

    def _reload(self, state, version: int) -> None:
        """Load `state` as `version`; samples in progress are flushed first and continue on the
        new weights from their logged tokens (re-prefilled: partial rollout), keeping their leases."""
        engine = self.engine
        assert engine is not None
        running: list[_Held] = []
        if self.held:
            self._flush(force=True, wait=True)  # every buffered token is logged under the old version
            running = [h for h in self.held.values() if h.finish is None]
            for held in running:
                self._engine_release(held.sample_id)
        self._wake()
        engine.load_weights(state, version)
        for held in running:
            if self.held.get(held.sample_id) is held:
                engine.add(replace(held.claim, generated_ids=list(held.prefix)).request())
        self.stats.weight_loads += 1
        self._claim_after = 0.0

    def _load_direct(self, version: int) -> None:
        """Load `version` from the trainer in this process once it is handed over."""
        direct, engine = self._direct_weights, self.engine
        assert direct is not None and engine is not None
        state = direct.take(version)
        if state is None:
            if self._missing_version != version:
                log.info("waiting for the trainer to hand over policy version %d", version)
                self._missing_version = version
            return
        self._reload(state, version)
        log.info("loaded policy version %d from the trainer (in process)", version)

    def _pull(self, version: int) -> None:
        """Pull `version` once it is announced (docs/internals.md §6), from peers that hold it
        or the trainer, else the store; a failed pull is retried at the next poll."""
        engine = self.engine
        assert engine is not None
        announced = latest_version(self.client, self.config.run_id)
        puller = self._puller or self._open_puller()
        if announced is None or announced < version or puller is None:
            if self._missing_version != version:
                log.info("waiting for policy version %d to be announced (latest: %s)", version, announced)
                self._missing_version = version
            return
        try:
            state = puller.pull(version)
        except PullError as exc:
            log.warning("pulling policy version %d failed (%s); retrying", version, exc)
            return
        self._reload(state, version)
        report = puller.last_report
        if report is not None:
            report_transfer(self.client, self.config.run_id, report)
            log.info("loaded policy version %d (%d bytes) in %.2f s", version, report.bytes, report.seconds)

    def _open_puller(self) -> WeightPuller | None:
        """The weight puller, made from the settings the trainer shared (None before that)."""
        settings = shared_config(self.client, self.config.run_id)
        if settings is None:
            return None
        self._puller = WeightPuller(settings, self.client, self.config.run_id, self.config.instance_id)
        return self._puller

    def _can_claim(self) -> bool:
        if self._stop.is_set() or self._step is None or self.engine is None:
            return False
        window, held_version = self._step, self.engine.policy_version
        in_window = held_version == window.version if window.staleness == 0 else held_version is not None
        return self._paused_step != window.first and in_window and len(self.held) < self.config.slots

    def _maybe_claim(self) -> None:
        if not self._can_claim() or time.monotonic() < self._claim_after:
            return
        assert self._step is not None
        self._wake()
        free = self.config.slots - len(self.held)
        version = self.engine.policy_version  # type: ignore[union-attr]
        claims = self.tokenlog.claim(self._step.steps, self.config.instance_id, version, free)
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
        if self.config.restart_from_scratch and claim.generated_ids:
            # The baseline does not resume: drop the logged tokens; the sample is queued again
            # empty and claimed later from scratch.
            self.tokenlog.release(claim.sample_id, self.config.instance_id, claim.epoch, keep_tokens=False)
            self._claim_after = 0.0
            return
        try:
            engine.add(claim.request())
        except ValueError as exc:
            log.error("sample %s cannot be generated (%s): failing it", claim.sample_id, exc)
            self.tokenlog.fail(claim.sample_id, self.config.instance_id, claim.epoch, f"engine: {exc}")
            self.stats.failed += 1
            return
        self._claims += 1
        self.held[claim.sample_id] = _Held(
            claim.sample_id, claim.epoch, len(claim.generated_ids), self._claims, claim, list(claim.generated_ids)
        )
        self.stats.claimed += 1
        self.stats.resumed += bool(claim.generated_ids)

    def _absorb(self, chunks: list) -> None:
        now = time.monotonic()
        for chunk in chunks:
            held = self.held.get(chunk.sample_id)
            if held is None:
                continue
            if chunk.token_ids:
                if not held.tokens:
                    held.since = now
                held.tokens += chunk.token_ids
                held.logprobs += chunk.logprobs
                self.stats.tokens += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                held.finish = chunk.finish_reason

    def _flush(self, force: bool, only: list[_Held] | None = None, wait: bool = False) -> None:
        """Submit one round trip for every due flush (all of `only`'s pending tokens if given)
        to the flush pipeline, after settling the one in flight; `wait` settles this one too."""
        self._flusher.settle()
        if only is not None:
            due = [h for h in only if self.held.get(h.sample_id) is h and (h.tokens or h.finish)]
        else:
            now = time.monotonic()
            k, t = self.config.flush_tokens, self._flush_s
            due = [
                h
                for h in self.held.values()
                if h.finish is not None or (h.tokens and (force or len(h.tokens) >= k or now - h.since >= t))
            ]
        if due:
            instance = self.config.instance_id
            batch = [(h, len(h.tokens), h.finish) for h in due]
            # With bounded staleness each flush names the version that generated it (all of its
            # tokens: a new version is loaded only after a forced flush); strictly on-policy the
            # claim's fence already made it the step's version.
            version = self.engine.policy_version if self._step is not None and self._step.staleness else None  # type: ignore[union-attr]
            flushes = [
                Flush(h.sample_id, instance, h.epoch, h.tokens[:n], h.logprobs[:n], h.logged, finish, version)
                for h, n, finish in batch
            ]
            self._flusher.submit(flushes, functools.partial(self._flushed, batch, time.monotonic()))
            self.stats.flushes += 1
        if wait:
            self._flusher.settle()

    def _flushed(self, batch: list[tuple[_Held, int, str | None]], submitted: float, results: list[bool]) -> None:
        """Apply a settled batch: accepted tokens become logged, a rejection drops the sample."""
        for (held, count, finish), ok in zip(batch, results):
            if self.held.get(held.sample_id) is not held:
                continue  # re-claimed under a new lease meanwhile: this flush was fenced off
            if not ok:
                self._drop(held, "flush rejected")
                continue
            held.logged += count
            held.prefix += held.tokens[:count]
            del held.tokens[:count], held.logprobs[:count]
            if held.tokens:  # generated while the round trip was in flight
                held.since = submitted
            if finish is not None:
                del self.held[held.sample_id]
                self.stats.finished += 1

    def _drop(self, held: _Held, why: str) -> None:
        """The lease was revoked (reaped or stolen): forget the sample, write nothing more."""
        if self.held.get(held.sample_id) is held:
            del self.held[held.sample_id]
        self._engine_release(held.sample_id)
        self.stats.dropped += 1
        log.info("dropped sample %s (%s: lease revoked)", held.sample_id, why)

    def _engine_release(self, sample_id: str) -> None:
        try:
            self.engine.release(sample_id)  # type: ignore[union-attr]
        except KeyError:
            pass  # it had finished in the engine already

    # -- handing samples back -------------------------------------------------------------------

    def _release(self, samples: list[_Held], to: str | None = None, route_s: float = 5.0) -> None:
        """Stop generating `samples`, flush their tails, then release them (fenced; routed to
        instance `to` for `route_s` if given)."""
        samples = [h for h in samples if self.held.get(h.sample_id) is h]
        if not samples:
            return
        for held in samples:
            if held.finish is None:
                self._engine_release(held.sample_id)
        self._flush(force=True, only=samples, wait=True)  # finished ones complete, not migrate
        instance = self.config.instance_id
        for held in samples:
            if self.held.get(held.sample_id) is not held:
                continue  # finished, or dropped by the flush
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
        swept = self.tokenlog.release_all(self.config.instance_id)
        if swept:
            log.warning("released %d samples this worker did not know it owned", swept)

    # -- control messages -----------------------------------------------------------------------

    def _control(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "release":
            ids = message.get("sample_ids")
            if ids is not None:
                targets = [self.held[s] for s in ids if s in self.held]
            else:
                count = int(message.get("count", 0))
                running = [h for h in self.held.values() if h.finish is None]
                running.sort(key=lambda h: (h.generated, -h.order))  # the most work left first
                targets = running[: max(count, 0)]
            self._claim_after = time.monotonic() + STEAL_HOLDOFF_S
            to = message.get("to") or None
            log.info("releasing %d samples on request%s", len(targets), f" to {to}" if to else "")
            self._release(targets, to=to, route_s=float(message.get("route_s", 5.0)))
        elif op == "release_all":
            step = message.get("step", self._step.first if self._step else None)
            self._paused_step = None if step is None else int(step)
            log.info("releasing all %d samples; not claiming for step %s", len(self.held), step)
            self._release(list(self.held.values()))
        elif op == "resume":
            self._paused_step = None
            self._claim_after = 0.0
        elif op == "drain":
            self.request_stop("drain")
        else:
            log.warning("ignoring unknown control message %r", message)

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
                self.config.instance_id, engine.policy_version if engine else None, free, running
            )
        except redis.RedisError as exc:
            log.warning("heartbeat failed: %s", exc)
            return True
        if not ok and not self._hb_stop.is_set():
            log.warning("instance %s is no longer registered (evicted): stopping", self.config.instance_id)
            self.request_stop("evicted")
        return ok


# --- entry point ---------------------------------------------------------------------------------


def _engine_spec(text: str) -> EngineSpec:
    try:
        return EngineSpec.model_validate_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an engine spec: {exc}") from None


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="rlboost worker",
        description="Run a rollout instance: claim samples of the current step, generate, stream "
        "tokens to the token log. SIGTERM hands everything back and exits 0.",
    )
    p.add_argument(
        "--redis-url",
        default=env("RLBOOST_REDIS_URL"),
        help="Redis URL (env RLBOOST_REDIS_URL; prefer the environment: a command line, and so the "
        "password in the URL, is visible to every local user)",
    )
    p.add_argument(
        "--redis-ca-file",
        default=env(REDIS_CA_FILE_ENV),
        help=f"PEM file of the CA of a rediss:// Redis (env {REDIS_CA_FILE_ENV}; default: the system's trust store)",
    )
    p.add_argument("--run-id", default=env("RLBOOST_RUN_ID"), help="run id (env RLBOOST_RUN_ID)")
    p.add_argument(
        "--instance-id",
        default=env("RLBOOST_INSTANCE_ID"),
        help="instance id (env RLBOOST_INSTANCE_ID; default <pool>-<host>-<pid>)",
    )
    p.add_argument("--pool", default=env("RLBOOST_POOL"), help="pool name (env RLBOOST_POOL)")
    p.add_argument(
        "--capacity-class",
        default=env("RLBOOST_CAPACITY_CLASS", "spot"),
        choices=["reserved", "ondemand", "spot"],
        help="env RLBOOST_CAPACITY_CLASS (default spot)",
    )
    p.add_argument("--price-per-hour", type=float, default=0.0)
    p.add_argument("--model", required=True, help="base HF model directory or URL (version 0)")
    add_worker_flags(p)
    defaults = WorkerConfig.model_fields
    p.add_argument(
        "--engine",
        type=_engine_spec,
        default=EngineSpec(),
        help='the engine, as EngineSpec JSON, e.g. \'{"kind": "vllm", "device": "cpu", "dtype": "bf16"}\' (default hf)',
    )
    p.add_argument("--poll-ms", type=float, default=defaults["poll_ms"].default)
    p.add_argument(
        "--threads", type=int, default=TORCH_THREADS, help=f"torch intra-op threads (default {TORCH_THREADS})"
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run a `RolloutWorker` until it stops; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("redis_url", "run_id", "pool"):
        if not getattr(args, name):
            parser.error(f"--{name.replace('_', '-')} is required (or its environment variable)")
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    instance_id = args.instance_id or f"{args.pool}-{socket.gethostname()}-{os.getpid()}"
    config = WorkerConfig(
        redis_url=args.redis_url,
        redis_ca_file=args.redis_ca_file,
        run_id=args.run_id,
        instance_id=instance_id,
        pool=args.pool,
        capacity_class=args.capacity_class,
        price_per_hour=args.price_per_hour,
        model_path=args.model,
        engine=args.engine,
        poll_ms=args.poll_ms,
        **settings_from_flags(args),
    )
    import torch

    torch.set_num_threads(args.threads)
    worker = RolloutWorker(config)
    worker.install_signal_handlers()  # before the (slow) model load: a notice then stops at once
    watch_driver(lambda: worker.request_stop("driver gone"))  # no orphan when the driver is killed
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
