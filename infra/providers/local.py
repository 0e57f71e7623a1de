"""Local pools whose instances are real process groups, preempted with real signals.

`LocalProvider` owns the processes it starts: each instance is a new session (process group)
running `command_factory(pool, instance_id)` with `RLBOOST_INSTANCE_ID`, `RLBOOST_POOL`,
`RLBOOST_CAPACITY_CLASS`, the owner's `environment` (secrets, never on a command line), this
process's pid (`RLBOOST_DRIVER_PID`, `rl.driver_watch`) and, in a pool of `placement`, its GPU slot's
`CUDA_VISIBLE_DEVICES` (`infra.providers.placement`; with no slot free it starts once one is).
`tick()` (by its owner, or every `interval_s` from `start()`'s thread) reaps exited instances (exit
0 `finished`, else `crashed`) and replaces them while the pool is below target; after a failed
start (a crash within `START_WINDOW_S`) the pool's next launch backs off (doubling, up to
`MAX_RESTART_BACKOFF_S`; `infra.fleet.instance_watch` gives up on a pool, reading `last_log_line`);
it SIGKILLs stopping instances whose notice ran out and keeps each pool at `min(target, capacity
now)`: the excess gets SIGTERM, then SIGKILL after the notice (or, `silent_kill_fraction` of the
time, at once). `shutdown()` stops everything; a finalizer kills what is left. A `WarmStart`'s
pools fork from a template (`infra.providers.warm_start`). Detail: internals §3.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Self

from infra.availability.traces import TraceSchedule
from infra.providers.instance_process import FreshProcess, InstanceProcess, signal_group
from infra.providers.interface import InstanceHandle, InstanceRecord, PreemptionEvent, Provider, StopReason
from infra.providers.placement import GpuSlot
from infra.providers.pool import PoolSpec
from infra.providers.warm_start import WarmStart, instance_template_environment
from rl import env_vars
from rl.disk_space import LOW_SPACE_BYTES, describe_free, free_bytes
from rl.driver_watch import driver_environment
from rl.warm_fork.client import TemplateUnavailable, shared_template, warm_command

log = logging.getLogger(__name__)

CommandFactory = Callable[[PoolSpec, str], Sequence[str]]

START_WINDOW_S = 60.0
"""An instance that crashes this soon after its launch failed to start (a bad model, engine, disk)."""
RESTART_BACKOFF_S = 1.0
"""Wait before relaunching after the first failed start; doubled after each further one."""
MAX_RESTART_BACKOFF_S = 30.0
"""The longest wait before a relaunch."""


@dataclass
class _Pool:
    spec: PoolSpec
    schedule: TraceSchedule | None
    origin: float
    """Provider clock when the pool was first used: wall time 0 of its schedule."""
    notice_s: float
    """The local notice period: `spec.notice_s` divided by the schedule's time compression."""
    target: int = 0
    launched: int = 0
    start_failures: int = 0
    """Instances in a row that crashed within `START_WINDOW_S` of their launch."""
    launch_after: float = 0.0
    """No replacement starts before this provider time (the back-off after a failed start)."""
    free_slots: list[GpuSlot] | None = None
    """The pool's GPU slots no instance holds (None: the pool is not placed)."""


@dataclass
class _Instance:
    record: InstanceRecord
    proc: InstanceProcess
    kill_at: float | None = None
    """When a stopping instance gets SIGKILL (None while running)."""
    slot: GpuSlot | None = None
    """The GPUs it holds until it exits."""


class LocalProvider(Provider):
    """Pools of local process groups with trace-driven (or injected) preemption."""

    def __init__(
        self,
        command_factory: CommandFactory,
        *,
        schedules: dict[str, TraceSchedule] | None = None,
        clock: Callable[[], float] = time.time,
        seed: int = 0,
        log_dir: Path | None = None,
        environment: Mapping[str, str] | None = None,
        instance_prefix: str = "",
        placement: Mapping[str, Sequence[GpuSlot]] | None = None,
        warm_start: WarmStart | None = None,
    ) -> None:
        """`schedules` overrides the availability of the named pools (tests, replays); `clock` is
        the time source of `tick()` and of the records; `seed` drives which instances are
        preempted and which preemptions are silent; `log_dir` gets one `<instance>.log` each
        (stdout and stderr), else children inherit this process's streams; `environment` is added
        to every instance's environment (this process's own); instance ids are
        `<instance_prefix><pool>-<n>` (a re-run's attempt prefix, `infra.run.identity`);
        `placement` holds the GPU slots of each placed pool (`infra.providers.placement.place`);
        the instances of the unplaced pools `warm_start` names fork from a template."""
        self._command_factory = command_factory
        self._placement = {name: list(slots) for name, slots in (placement or {}).items()}
        self._instance_prefix = instance_prefix
        self._environment = dict(environment or {})
        self._schedules = dict(schedules or {})
        self._clock = clock
        self._rng = random.Random(seed)
        self._log_dir = log_dir
        self._pools: dict[str, _Pool] = {}
        self._instances: dict[str, _Instance] = {}
        self._events: list[PreemptionEvent] = []
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._procs: dict[str, InstanceProcess] = {}
        """Processes not yet reaped: what the finalizer kills."""
        self._warm_start = warm_start
        self._finalizer = weakref.finalize(self, _kill_all, self._lock, self._closed, self._procs)
        self._ticker = TickThread("local-provider")

    # -- Provider -------------------------------------------------------------------------------

    def launch(self, pool: PoolSpec, count: int) -> list[InstanceHandle]:
        """Raise the pool's target by `count` (up to `pool.size`) and start what capacity allows
        now; the rest start on a later `tick()` when capacity returns."""
        if pool.provider != "local":
            raise ValueError(
                f"pool {pool.name}: provider {pool.provider!r} is not local; the local provider runs "
                "only `provider: local` pools (cloud pools go to their cloud's provider)"
            )
        with self._lock:
            self._check_open()
            state = self._pool(pool)
            if count < 0 or state.target + count > pool.size:
                raise ValueError(f"pool {pool.name}: target {state.target} + {count} exceeds size {pool.size}")
            state.target += count
            now = self._clock()
            room = min(state.target, self._capacity(state, now)) - len(self._running(pool.name))
            started = (self._start(state, now) for _ in range(min(count, max(room, 0))))
            return [handle for handle in started if handle is not None]

    def instances(self, live_only: bool = False) -> list[InstanceRecord]:
        with self._lock:
            records = [i.record for i in self._instances.values()]
            return [r for r in records if not live_only or r.state != "terminated"]

    def describe(self, instance_id: str) -> InstanceRecord:
        with self._lock:
            if instance_id not in self._instances:
                raise KeyError(f"unknown instance {instance_id!r}")
            return self._instances[instance_id].record

    def terminate(self, instance_id: str, reason: StopReason = "scaled_down") -> None:
        """Stop an instance. `scaled_down` also lowers its pool's target by one; a `preempted`
        (injected) or `crashed` (a failed instance) stop leaves the target, so a replacement
        starts when capacity allows."""
        with self._lock:
            instance = self._instances.get(instance_id)
            if instance is None:
                raise KeyError(f"unknown instance {instance_id!r}")
            if instance.record.state != "running":
                return
            pool = self._pools[instance.record.pool]
            if reason == "scaled_down":
                pool.target -= 1
            self._stop(instance, pool, reason, self._clock())

    def preemptions(self) -> list[PreemptionEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def quote(self, pool: PoolSpec) -> float:
        return pool.price_per_hour

    # -- driving --------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """Reap exits, enforce notice deadlines, and bring every pool to `min(target, capacity)`."""
        with self._lock:
            if self._closed.is_set():
                return
            now = self._clock() if now is None else now
            self._reap(now)
            for instance in self._instances.values():
                if instance.kill_at is not None and now >= instance.kill_at:
                    signal_group(instance.proc, signal.SIGKILL)
            for state in self._pools.values():
                allowed = min(state.target, self._capacity(state, now))
                running = self._running(state.spec.name)
                if any(now - i.record.launched_at >= START_WINDOW_S for i in running):
                    state.start_failures = 0  # one of them started
                excess = len(running) - allowed
                for instance in self._rng.sample(running, max(excess, 0)):
                    silent = self._rng.random() < state.spec.silent_kill_fraction
                    self._stop(instance, state, "preempted_silent" if silent else "preempted", now)
                if now < state.launch_after:
                    continue
                for _ in range(-excess):
                    if self._start(state, now) is None:
                        break

    def start(self, interval_s: float = 0.1) -> None:
        """Call `tick()` every `interval_s` seconds on a helper thread until `stop()`/`shutdown()`."""
        self._ticker.start(self, interval_s)

    def stop(self) -> None:
        """Stop the helper thread (instances keep running)."""
        self._ticker.stop()

    def shutdown(self, grace_s: float = 2.0) -> None:
        """Stop the thread, SIGTERM every instance, SIGKILL what is left after `grace_s` (real)
        seconds, reap all. The provider is closed afterwards."""
        self.stop()
        with self._lock:
            now = self._clock()
            for instance in self._instances.values():
                if instance.record.state == "running":
                    self._stop(instance, self._pools[instance.record.pool], "scaled_down", now)
            self._closed.set()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not all(p.exited() for p in self._procs.values()):
            time.sleep(0.02)
        with self._lock:
            for proc in self._procs.values():
                signal_group(proc, signal.SIGKILL)
                proc.wait_exited()  # reaped below
            self._reap(self._clock())
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals (called with the lock held) --------------------------------------------------

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise RuntimeError("the provider is shut down")

    def _pool(self, spec: PoolSpec) -> _Pool:
        state = self._pools.get(spec.name)
        if state is None:
            schedule = self._schedules.get(spec.name) or spec.schedule()
            compression = schedule.time_compression if schedule else 1.0
            state = _Pool(spec, schedule, self._clock(), spec.notice_s / compression)
            if spec.name in self._placement:
                state.free_slots = list(self._placement[spec.name])
            self._pools[spec.name] = state
        elif state.spec != spec:
            raise ValueError(f"pool {spec.name!r} is already in use with a different spec")
        return state

    def _capacity(self, state: _Pool, now: float) -> int:
        if state.schedule is None:
            return state.spec.size
        return state.schedule.capacity_at(max(now - state.origin, 0.0))

    def _running(self, pool: str) -> list[_Instance]:
        return [i for i in self._instances.values() if i.record.pool == pool and i.record.state == "running"]

    def _start(self, state: _Pool, now: float) -> InstanceHandle | None:
        """Start one instance of the pool; None when it is placed and an exiting instance still
        holds every slot (a later tick starts it)."""
        spec = state.spec
        slot = None
        if state.free_slots is not None:
            if not state.free_slots:
                return None
            slot = state.free_slots.pop(0)
        instance_id = f"{self._instance_prefix}{spec.name}-{state.launched}"
        env = {
            **os.environ,
            **self._environment,
            **driver_environment(),  # an instance whose owner died stops by itself
            env_vars.INSTANCE_ID: instance_id,
            env_vars.POOL: spec.name,
            env_vars.CAPACITY_CLASS: spec.capacity_class,
            **({} if slot is None else slot.environment()),
        }
        command = list(self._command_factory(spec, instance_id))
        log_path = None if self._log_dir is None else self._log_dir / f"{instance_id}.log"
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        warm = slot is None and self._warm_start is not None and spec.name in self._warm_start.pools
        proc = (self._forked(command, env, log_path) if warm else None) or _fresh(command, env, log_path)
        state.launched += 1
        record = InstanceRecord(
            instance_id, spec.name, spec.capacity_class, spec.machine_type, spec.price_per_hour, launched_at=now
        )
        self._instances[instance_id] = _Instance(record, proc, slot=slot)
        self._procs[instance_id] = proc
        if slot is not None:
            log.info("instance %s started on GPUs %s", instance_id, ",".join(slot.devices))
        return record

    def _forked(self, command: list[str], env: dict[str, str], log_path: Path | None) -> InstanceProcess | None:
        """The instance forked from this process's template for its environment (`shared_template`:
        a new one when the environment changed); None when it must start fresh (not a `python -m`
        command of this interpreter, or the template failed)."""
        assert self._warm_start is not None
        if not warm_command(command):
            return None
        base = instance_template_environment(env, self._environment)
        template_log = None if self._log_dir is None else self._log_dir / "fork-template.log"
        try:
            template = shared_template(self._warm_start.preload, base, template_log)
            return template.start(command, env, log_path)
        except (TemplateUnavailable, OSError) as error:  # (OSError: the template could not be started)
            log.debug("instance starts fresh: %s", error)
            return None

    def _stop(self, instance: _Instance, state: _Pool, reason: StopReason, now: float) -> None:
        silent = reason in ("preempted_silent", "crashed")  # a failed instance holds nothing to hand back
        instance.kill_at = now if silent else now + state.notice_s
        instance.record = replace(instance.record, state="terminating", notice_at=now, reason=reason)
        signal_group(instance.proc, signal.SIGKILL if silent else signal.SIGTERM)
        if reason in ("preempted", "preempted_silent"):
            event = PreemptionEvent(instance.record.instance_id, state.spec.name, now, instance.kill_at, silent)
            self._events.append(event)

    def _reap(self, now: float) -> None:
        """Record every instance whose group leader exited; sweep what is left of its group."""
        for instance_id, proc in list(self._procs.items()):
            if not proc.exited():
                continue
            signal_group(proc, signal.SIGKILL)  # the leader is a zombie until waited: its pgid is not reused
            code = proc.reap()
            del self._procs[instance_id]
            instance = self._instances[instance_id]
            free = self._pools[instance.record.pool].free_slots
            if instance.slot is not None and free is not None:
                free.append(instance.slot)
                instance.slot = None
            reason = instance.record.reason or ("finished" if code == 0 else "crashed")
            instance.record = replace(
                instance.record, state="terminated", terminated_at=now, reason=reason, exit_code=code
            )
            instance.kill_at = None
            if reason == "crashed" and now - instance.record.launched_at < START_WINDOW_S:
                self._failed_start(self._pools[instance.record.pool], instance, now)

    def _failed_start(self, state: _Pool, instance: _Instance, now: float) -> None:
        """Back off the pool's next launch: `RESTART_BACKOFF_S`, doubled per failed start in a row."""
        state.start_failures += 1
        wait = min(RESTART_BACKOFF_S * 2 ** (state.start_failures - 1), MAX_RESTART_BACKOFF_S)
        state.launch_after = now + wait
        log.warning(
            "instance %s exited %s %.1f s after its launch (failed start %d in a row of pool %s); next launch in %.0f s",
            instance.record.instance_id,
            instance.record.exit_code,
            now - instance.record.launched_at,
            state.start_failures,
            state.spec.name,
            wait,
        )

    def last_log_line(self, instance_id: str) -> str:
        """The last line of an instance's log (a worker that cannot start says why there) and the
        log's path, on one line; a full disk is said too. '' without a log directory."""
        if self._log_dir is None:
            return ""
        path = self._log_dir / f"{instance_id}.log"
        free = free_bytes(self._log_dir)
        full = (
            f"; its disk is full: {describe_free(self._log_dir)}" if free is not None and free < LOW_SPACE_BYTES else ""
        )
        try:
            lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError as exc:
            return f"cannot read its log {path}: {exc}{full}"
        return f"{lines[-1] if lines else 'its log is empty'} (its log: {path}{full})"


def _fresh(command: list[str], env: dict[str, str], log_path: Path | None) -> FreshProcess:
    """The instance started as a new interpreter in a new session, its output to `log_path`."""
    if log_path is None:
        return FreshProcess(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True))
    with log_path.open("ab") as out:
        popen = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return FreshProcess(popen)


class TickThread:
    """Calls `owner.tick()` every `interval_s` seconds on a daemon thread between `start` and
    `stop`. It holds the owner weakly, so an owner dropped without `stop` ends the thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, owner: Any, interval_s: float) -> None:
        if self._thread is not None:
            raise RuntimeError("the tick thread is already running")
        self._stop.clear()
        self._thread = threading.Thread(
            target=_tick_loop,
            args=(weakref.ref(owner), self._stop, interval_s, self.name),
            name=self.name,
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None


def _tick_loop(owner: weakref.ref, stop: threading.Event, interval_s: float, name: str) -> None:
    while not stop.wait(interval_s):
        live = owner()
        if live is None:
            return
        try:
            live.tick()
        except Exception:
            log.exception("%s tick failed", name)
        del live


def _kill_all(lock: threading.RLock, closed: threading.Event, procs: dict[str, InstanceProcess]) -> None:
    """Finalizer: close the provider, SIGKILL every group it has not reaped."""
    with lock:
        closed.set()
        for proc in procs.values():
            signal_group(proc, signal.SIGKILL)
            proc.wait_exited()
            proc.reap()
        procs.clear()
