"""Failed rollout instances: found, stopped so that their pool replaces them, and counted.

`InstanceWatch` looks at a run's instances (a `Provider`'s records) beside the registry's members
and, for instances whose worker runs as a Prefect flow run, how that run ended (`WorkerEnd`). An
instance failed when its worker exited by itself (`crashed` or `finished`, not asked to stop:
preempted, scaled down, drained), when it runs on after its worker's flow run ended (a VM left
idle; at once for a Failed run, after `settle_s` otherwise, so that a preemption is recorded as
one), when it has not registered `register_timeout_s` after its launch, or when it held no
policy version the open step accepts for `stall_s` (`fabric.weights.stall_s`). A live failed
instance is stopped (reason `crashed`: it holds nothing the run can use); its pool's provider
(`LocalProvider.tick`) or the capacity manager launches its replacement. `replaced` counts them;
an instance seen registered and holding an accepted version (or while no step is open) resets
its pool's count, and `max_failures` in a row raise `PoolFailure` naming the last one's error.
`check()` runs at the step's polls (and at its start and end); clock injected. docs/internals.md §3.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from infra.providers.interface import InstanceRecord, Provider
from infra.providers.pool import PoolSpec

log = logging.getLogger(__name__)

WATCH_S = 2.0
"""Shortest pause between two looks (the registry and the flow runs are read at each)."""


@dataclass(frozen=True)
class WorkerEnd:
    """How the flow run of an instance's worker ended."""

    state: str
    """The run's final state type: `FAILED`, `CRASHED`, `COMPLETED` or `CANCELLED`."""
    message: str
    at: float
    """Epoch seconds of the final state."""


class PoolFailure(RuntimeError):
    """A pool whose last `fabric.max_instance_failures` instances in a row failed; the message (one
    line) names the last one and its error."""

    def __init__(self, pool: str, failures: int, instance_id: str, error: str) -> None:
        super().__init__(
            f"pool {pool}: {failures} instances in a row failed (fabric.max_instance_failures); "
            f"the last, {instance_id}, {error}"
        )
        self.pool = pool
        self.instance_id = instance_id


class InstanceWatch:
    """Finds the failed instances of `pools`, stops them to be replaced, and gives up on a pool
    whose instances keep failing."""

    def __init__(
        self,
        provider: Provider,
        pools: Sequence[PoolSpec],
        *,
        registered: Callable[[], Mapping[str, int | None]],
        max_failures: int,
        register_timeout_s: float,
        settle_s: float,
        worker_ends: Callable[[Collection[str]], Mapping[str, WorkerEnd]] = lambda live: {},
        explain: Callable[[str], str] = lambda instance_id: "",
        clock: Callable[[], float] = time.time,
        interval_s: float = WATCH_S,
        accepted: Callable[[], int | None] = lambda: None,
        stall_s: float = math.inf,
    ) -> None:
        """`registered()`: the instances registered now, each with the policy version it holds
        (None: none yet); `worker_ends(live)`: how the flow runs of those of `live` whose run ended
        ended; `explain(id)`: one line on why an instance that exited did (its log's last line, its
        run's message), or ''; `accepted()`: the oldest policy version the open step accepts (None:
        no step is open); `stall_s`: how long an instance may hold none it accepts."""
        self.provider = provider
        self.pools = {pool.name for pool in pools}
        self._registered_now = registered
        self._worker_ends = worker_ends
        self._explain = explain
        self._max_failures = max_failures
        self._register_timeout_s = register_timeout_s
        self._settle_s = settle_s
        self._accepted = accepted
        self._stall_s = stall_s
        self._clock = clock
        self._interval_s = interval_s
        self._looked_at = float("-inf")
        self._registered: set[str] = set()
        """Instances seen registered."""
        self._working: set[str] = set()
        """Instances seen registered holding an accepted version, or while no step was open (an
        instance's pool count resets when it is first seen so)."""
        self._behind: dict[str, tuple[int | None, float]] = {}
        """Per instance holding no accepted version: the version it holds and since when it was seen so."""
        self._expected: set[str] = set()
        """Instances asked to finish (a drain): their end is no failure."""
        self._judged: set[str] = set()
        self._in_a_row: dict[str, int] = {}
        self.replaced = 0
        """Failed instances found so far (each replaced by its pool's provider or capacity manager)."""
        self.failure: PoolFailure | None = None

    def expect_end(self, instance_id: str) -> None:
        """`instance_id` was asked to finish its work: its worker's end is not a failure."""
        self._expected.add(instance_id)

    def check(self, force: bool = False) -> None:
        """Look (at most every `interval_s`, unless `force`): stop the failed instances, count them,
        and raise `PoolFailure` once a pool's failures in a row reach `max_failures` (again at
        every call)."""
        if self.failure is not None:
            raise self.failure
        now = self._clock()
        if now - self._looked_at < self._interval_s and not force:
            return
        self._looked_at = now
        records = {r.instance_id: r for r in self.provider.instances() if r.pool in self.pools}
        held = dict(self._registered_now())
        accepted = self._accepted() if held else None
        for instance_id, version in held.items():
            self._registered.add(instance_id)
            working = accepted is None or (version is not None and version >= accepted)
            if working and instance_id not in self._working and instance_id in records:
                self._working.add(instance_id)
                self._in_a_row[records[instance_id].pool] = 0
        live = [r.instance_id for r in records.values() if r.state == "running"]
        ends = self._worker_ends(live) if live else {}
        for record in records.values():
            if record.instance_id in self._judged or record.instance_id in self._expected:
                continue
            error = self._failed(record, ends.get(record.instance_id), now) or self._stalled(
                record, held, accepted, now
            )
            if error is not None:
                self._judged.add(record.instance_id)
                if record.state == "running":
                    self.provider.terminate(record.instance_id, "crashed")
                self._count(record, error)
        if self.failure is not None:
            raise self.failure

    def _failed(self, record: InstanceRecord, end: WorkerEnd | None, now: float) -> str | None:
        """What `record`'s instance failed of, or None if it did not (yet)."""
        registered = record.instance_id in self._registered
        if record.state == "terminated":
            if record.reason not in ("crashed", "finished"):
                return None  # stopped by its provider or the run: preempted, scaled down
            when = (record.terminated_at or now) - record.launched_at
            moment = "after it registered" if registered else f"{when:.0f} s after its launch, before it registered"
            return _sentence(f"exited with status {record.exit_code} {moment}", self._explain(record.instance_id))
        if record.state != "running":
            return None
        if end is not None and (end.state == "FAILED" or now - end.at >= self._settle_s):
            return _sentence(f"its worker's flow run ended {end.state}", end.message)
        if not registered and now - record.launched_at >= self._register_timeout_s:
            return (
                f"did not register within {self._register_timeout_s:.0f} s of its launch "
                "(fabric.register_timeout_s); it was stopped"
            )
        return None

    def _stalled(
        self, record: InstanceRecord, held: Mapping[str, int | None], accepted: int | None, now: float
    ) -> str | None:
        """Why `record`'s instance failed by holding no accepted version for `stall_s`, or None. Its
        clock starts again whenever the version it holds changes (a slow instance that keeps up)."""
        instance_id = record.instance_id
        version = held.get(instance_id)
        if (
            record.state != "running"
            or accepted is None
            or instance_id not in held
            or (version is not None and version >= accepted)
        ):
            self._behind.pop(instance_id, None)
            return None
        behind = self._behind.get(instance_id)
        if behind is None or behind[0] != version:
            self._behind[instance_id] = behind = (version, now)
        if now - behind[1] < self._stall_s:
            return None
        holds = "none" if version is None else f"version {version}"
        return (
            f"held no policy version the step accepts (>= {accepted}; it holds {holds}) for "
            f"{self._stall_s:.0f} s (fabric.weights.stall_s): its log says which pulls failed; it was stopped"
        )

    def _count(self, record: InstanceRecord, error: str) -> None:
        self.replaced += 1
        failures = self._in_a_row[record.pool] = self._in_a_row.get(record.pool, 0) + 1
        log.warning(
            "instance %s of pool %s failed (%d in a row of %d allowed): %s",
            record.instance_id,
            record.pool,
            failures,
            self._max_failures,
            error,
        )
        if failures >= self._max_failures and self.failure is None:
            self.failure = PoolFailure(record.pool, failures, record.instance_id, error)


def _sentence(what: str, why: str) -> str:
    """`what`, then `why` (one line) if there is one."""
    why = " ".join(why.split())
    return f"{what}: {why}" if why else what
