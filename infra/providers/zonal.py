"""`ZonalCloudProvider`: what the GCP and Azure providers share (records, zone failover with
back-off, preemption classification, labels), which turns a few per-cloud calls into the whole
`Provider` interface.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from infra.providers.errors import ZoneUnavailable
from infra.providers.interface import (
    BootHooks,
    BootPlan,
    InstanceHandle,
    InstanceRecord,
    OnChange,
    PreemptionEvent,
    Provider,
    StopReason,
)
from infra.providers.pool import PoolSpec

log = logging.getLogger(__name__)

LABEL_RUN = "rlboost-run"
LABEL_POOL = "rlboost-pool"
LABEL_STEP = "rlboost-step"
LABEL_VALUE_MAX = 63
"""GCP's limit on label values (Azure tags allow 256)."""


def label_value(text: str) -> str:
    """`text` as a label value both clouds accept: lowercase letters, digits, `-`, `_`; 63 at most."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:LABEL_VALUE_MAX]


def instance_labels(run_id: str, pool: str, step: int) -> dict[str, str]:
    """The labels (GCP) or tags (Azure) of every cloud instance, for cost attribution and discovery."""
    return {LABEL_RUN: label_value(run_id), LABEL_POOL: label_value(pool), LABEL_STEP: str(step)}


@dataclass(frozen=True)
class OperationPolling:
    """How a cloud provider waits on the cloud's API and its long-running operations."""

    interval_s: float = 2.0
    """Pause between two polls of an unfinished operation."""
    timeout_s: float = 600.0
    """Longest wait for one VM's creation; a VM still being created after it is left to `refresh()`
    (which adopts it if it comes up)."""
    request_timeout_s: float = 60.0
    """Timeout of each API request."""


ObservedStatus = Literal["running", "stopping", "stopped"]


@dataclass(frozen=True)
class ObservedInstance:
    """One of the run's instances as the cloud lists it now."""

    name: str
    pool: str
    zone: str
    status: ObservedStatus
    """`running` (provisioning and booting included), `stopping` (being preempted or deleted) or
    `stopped` (halted: it no longer runs or bills compute)."""
    created_at: float | None = None
    """When the cloud created it (epoch seconds), if it says."""
    launch_step: int | None = None
    """Its `rlboost-step` label."""


@dataclass(frozen=True)
class LabelledVm:
    """A VM of this project found by its labels in a pool's scope, whichever run launched it (the
    VM sweep's view: `ZonalCloudProvider.labelled`)."""

    provider: str
    name: str
    zone: str
    run_label: str
    """Its `rlboost-run` label (`label_value` of the run id)."""
    pool_label: str
    status: ObservedStatus
    created_at: float | None
    scope: PoolSpec
    """The configured pool whose project and zones (GCP) or resource group (Azure) it was found in."""


class ZoneFailover:
    """The zones of one pool to try, in order, skipping those in back-off after a failure.

    A zone that failed `k` times in a row is skipped for `min(backoff_s * 2**(k-1), max_backoff_s)`;
    a quota failure blocks every zone of its region (quotas are regional). A success resets the count.
    """

    def __init__(
        self, zones: Sequence[str], region_of: Callable[[str], str], backoff_s: float, max_backoff_s: float
    ) -> None:
        self.zones = tuple(zones)
        self._region_of = region_of
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._failures = dict.fromkeys(self.zones, 0)
        self._blocked_until = dict.fromkeys(self.zones, float("-inf"))

    def candidates(self, now: float) -> list[str]:
        """Zones not in back-off at `now`, in failover order."""
        return [zone for zone in self.zones if self._blocked_until[zone] <= now]

    def failed(self, error: ZoneUnavailable, now: float) -> float:
        """Back off from the failed zone (its region's zones, for quota); returns until when."""
        region = self._region_of(error.zone)
        hit = [z for z in self.zones if self._region_of(z) == region] if error.kind == "quota" else [error.zone]
        until = now
        for zone in hit:
            self._failures[zone] += 1
            delay = min(self._backoff_s * 2 ** (self._failures[zone] - 1), self._max_backoff_s)
            self._blocked_until[zone] = max(self._blocked_until[zone], now + delay)
            until = max(until, self._blocked_until[zone])
        return until

    def succeeded(self, zone: str) -> None:
        self._failures[zone] = 0


class ZonalCloudProvider(Provider):
    """A `Provider` over a cloud's zonal VM API: the part GCP and Azure share.

    A subclass supplies five calls (`_create`, `_delete`, `_observe`, `_notice_times`,
    `_quote_zone`) and `_region`; this class keeps the records, fails over between a pool's zones,
    classifies what `refresh()` observes, and emits the lifecycle:

    - `launch` creates VMs named `<pool>-<8 hex>` labelled with run, pool and step, in the pool's
      first zone that is not backing off; a zone out of capacity (a region out of quota) backs off
      and the rest go to the next zone. What no zone can take now is not started (the caller asks
      again later); configuration and credential errors are raised.
    - `refresh` lists the run's VMs of each pool: one that stops or disappears without being asked
      to is preempted (`preempted` with the cloud's notice time, else `preempted_silent`), and
      terminated once gone or halted; VMs of the run that no record knows (left by an earlier
      controller) are adopted.
    - `terminate` deletes the VM; its record ends when a later `refresh` no longer sees it.

    Every record change goes to `on_change`; `list()` holds the latest records. `launch`,
    `terminate` and `refresh` belong to one driver (the capacity manager); `list`, `describe` and
    `preemptions` are safe from any thread.
    """

    provider_name: ClassVar[str]
    """The `PoolSpec.provider` this class serves."""

    def __init__(
        self,
        *,
        run_id: str,
        current_step: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.time,
        on_change: OnChange | None = None,
        boot_hooks: BootHooks | None = None,
        backoff_s: float = 60.0,
        max_backoff_s: float = 900.0,
    ) -> None:
        """`current_step` gives the step label of new instances; `clock` (epoch seconds) times the
        records and the zone back-offs (`backoff_s` doubling up to `max_backoff_s`); `boot_hooks`
        prepare each instance's work before its VM is created."""
        self.run_id = run_id
        self._boot_hooks = boot_hooks
        self._current_step = current_step
        self._clock = clock
        self._on_change = on_change
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._pools: dict[str, PoolSpec] = {}
        self._failover: dict[str, ZoneFailover] = {}
        self._records: dict[str, InstanceRecord] = {}
        self._events: list[PreemptionEvent] = []
        self._lock = threading.Lock()

    # -- per cloud ------------------------------------------------------------------------------

    @abstractmethod
    def _create(
        self, pool: PoolSpec, zone: str, names: Sequence[str], labels: dict[str, str], plans: dict[str, BootPlan]
    ) -> tuple[list[str], ZoneUnavailable | None]:
        """Create one VM per name in `zone` (booting with its plan) and wait until each is created
        or has failed; returns the names created and, unless that is all of them, why the zone
        could not take the others."""

    @abstractmethod
    def _delete(self, pool: PoolSpec, zone: str, name: str) -> None:
        """Start deleting a VM (without waiting); a VM already gone is no error."""

    @abstractmethod
    def _observe(self, pool: PoolSpec) -> list[ObservedInstance]:
        """The run's VMs of `pool` that exist now, in any of its zones."""

    @abstractmethod
    def labelled(self, pool: PoolSpec) -> list[LabelledVm]:
        """Every VM in `pool`'s scope (its project's zones, its resource group) that carries an
        `rlboost-run` label, of any run and any pool: what the VM sweep judges."""

    def delete_labelled(self, vm: LabelledVm) -> None:
        """Start deleting a VM `labelled` found (a VM already gone is no error)."""
        self._delete(vm.scope, vm.zone, vm.name)

    @abstractmethod
    def _notice_times(self, pool: PoolSpec, zone: str, names: Sequence[str], now: float) -> dict[str, float]:
        """When the cloud gave each of these lost VMs of `zone` its preemption notice; a VM missing
        from the answer vanished without one."""

    @abstractmethod
    def _quote_zone(self, pool: PoolSpec, zone: str) -> float:
        """USD per instance-hour of `pool` in `zone` (live where possible, else the offline price)."""

    @abstractmethod
    def _region(self, zone: str) -> str:
        """The region a zone belongs to (its quota scope)."""

    # -- Provider -------------------------------------------------------------------------------

    def launch(self, pool: PoolSpec, count: int) -> list[InstanceHandle]:
        self._register(pool)
        with self._lock:
            running = sum(1 for r in self._records.values() if r.pool == pool.name and r.state == "running")
        if count < 0 or running + count > pool.size:
            raise ValueError(f"pool {pool.name}: {running} running + {count} exceeds size {pool.size}")
        failover = self._failover[pool.name]
        started: list[InstanceHandle] = []
        while len(started) < count:
            zones = failover.candidates(self._clock())
            if not zones:
                log.warning(
                    "pool %s: started %d of %d instances; every zone is backing off", pool.name, len(started), count
                )
                break
            zone = zones[0]
            price = self._quote_zone(pool, zone)
            step = self._current_step()
            names = [f"{pool.name}-{uuid.uuid4().hex[:8]}" for _ in range(count - len(started))]
            plans = {name: BootPlan() for name in names}
            if self._boot_hooks is not None:
                for name in names:
                    plans[name] = self._boot_hooks.before_boot(pool, name) or BootPlan()
            try:
                created, failure = self._create(pool, zone, names, instance_labels(self.run_id, pool.name, step), plans)
            except BaseException as error:
                self._never_booted(names, f"was not created: {error}")
                raise
            self._never_booted([n for n in names if n not in created], f"was not created: {failure}")
            now = self._clock()
            for name in created:
                record = InstanceRecord(
                    name,
                    pool.name,
                    pool.capacity_class,
                    pool.machine_type,
                    price,
                    launched_at=now,
                    zone=zone,
                    launch_step=step,
                )
                self._update(record)
                started.append(record)
            if failure is None:
                failover.succeeded(zone)
            else:
                until = failover.failed(failure, now)
                log.warning("pool %s: %s; backing off there for %.0f s", pool.name, failure, until - now)
        return started

    def instances(self, live_only: bool = False) -> list[InstanceRecord]:
        with self._lock:
            return [r for r in self._records.values() if not live_only or r.state != "terminated"]

    def describe(self, instance_id: str) -> InstanceRecord:
        with self._lock:
            if instance_id not in self._records:
                raise KeyError(f"unknown instance {instance_id!r}")
            return self._records[instance_id]

    def terminate(self, instance_id: str, reason: StopReason = "scaled_down") -> None:
        record = self.describe(instance_id)
        if record.state != "running":
            return
        pool = self._pools[record.pool]
        assert record.zone is not None
        self._delete(pool, record.zone, instance_id)
        now = self._clock()
        if reason in ("preempted", "preempted_silent"):
            silent = reason == "preempted_silent"
            self._emit(PreemptionEvent(instance_id, pool.name, now, now if silent else now + pool.notice_s, silent))
        self._update(replace(record, state="terminating", notice_at=now, reason=reason))

    def preemptions(self) -> list[PreemptionEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def quote(self, pool: PoolSpec) -> float:
        """The price in the zone the next instance would go to (the first one not backing off)."""
        self._register(pool)
        zones = self._failover[pool.name].candidates(self._clock()) or pool.zones
        return self._quote_zone(pool, zones[0])

    def refresh(self, pools: Sequence[PoolSpec] = ()) -> None:
        for pool in pools:
            self._register(pool)
        for pool in list(self._pools.values()):
            self._reconcile(pool, {seen.name: seen for seen in self._observe(pool)})

    # -- internals ------------------------------------------------------------------------------

    def _register(self, pool: PoolSpec) -> None:
        if pool.provider != self.provider_name:
            raise ValueError(f"pool {pool.name!r} has provider {pool.provider}, not {self.provider_name}")
        known = self._pools.get(pool.name)
        if known is None:
            self._pools[pool.name] = pool
            self._failover[pool.name] = ZoneFailover(pool.zones, self._region, self._backoff_s, self._max_backoff_s)
        elif known != pool:
            raise ValueError(f"pool {pool.name!r} is already in use with a different spec")

    def _reconcile(self, pool: PoolSpec, observed: dict[str, ObservedInstance]) -> None:
        now = self._clock()
        live = [r for r in self.instances(live_only=True) if r.pool == pool.name]
        lost = [r for r in live if r.state == "running" and _gone_or_going(observed.get(r.instance_id))]
        notices: dict[str, float] = {}
        for zone in {r.zone for r in lost if r.zone is not None}:
            names = [r.instance_id for r in lost if r.zone == zone]
            notices.update(self._notice_times(pool, zone, names, now))
        lost_ids = {r.instance_id for r in lost}
        for record in live:
            if record.instance_id in lost_ids:
                record = self._preempted(pool, record, notices.get(record.instance_id), now)
                self._update(record)
            seen = observed.get(record.instance_id)
            if seen is None or seen.status == "stopped":
                self._update(replace(record, state="terminated", terminated_at=now))
        known = {r.instance_id for r in self.instances()}
        for seen in observed.values():
            if seen.name not in known and seen.status == "running":
                log.info(
                    "pool %s: adopting %s in %s (launched by an earlier controller)", pool.name, seen.name, seen.zone
                )
                self._update(
                    InstanceRecord(
                        seen.name,
                        pool.name,
                        pool.capacity_class,
                        pool.machine_type,
                        self._quote_zone(pool, seen.zone),
                        launched_at=now if seen.created_at is None else seen.created_at,
                        zone=seen.zone,
                        launch_step=seen.launch_step,
                    )
                )

    def _preempted(self, pool: PoolSpec, record: InstanceRecord, notice_at: float | None, now: float) -> InstanceRecord:
        silent = notice_at is None
        at = now if notice_at is None else min(notice_at, now)
        self._emit(PreemptionEvent(record.instance_id, pool.name, at, at if silent else at + pool.notice_s, silent))
        log.info("pool %s: %s preempted%s", pool.name, record.instance_id, " without notice" if silent else "")
        return replace(record, state="terminating", notice_at=at, reason="preempted_silent" if silent else "preempted")

    def _never_booted(self, names: Sequence[str], why: str) -> None:
        if self._boot_hooks is None:
            return
        for name in names:
            try:
                self._boot_hooks.never_booted(name, why)
            except Exception:
                log.exception("could not undo the boot preparation of %s", name)

    def _emit(self, event: PreemptionEvent) -> None:
        with self._lock:
            self._events.append(event)

    def _update(self, record: InstanceRecord) -> None:
        with self._lock:
            self._records[record.instance_id] = record
        if self._on_change is not None:
            try:
                self._on_change(record)
            except Exception:
                log.exception("on_change failed for %s", record.instance_id)


def _gone_or_going(seen: ObservedInstance | None) -> bool:
    return seen is None or seen.status != "running"
