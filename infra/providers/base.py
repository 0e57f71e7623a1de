"""The provider interface: pools, instance handles and records, preemption events.

A **pool** (`PoolSpec`) is one kind of capacity (provider, machine type, capacity class) with a
price, a preemption notice period and, for the clouds, where and how to create its instances
(`GcpPoolSettings`, `AzurePoolSettings`). A `Provider` launches instances into pools, lists and
terminates them, reports preemptions and quotes prices. The local provider (real process groups)
implements it directly; the GCP and Azure providers share `ZonalCloudProvider` (below: records,
zone failover with back-off, preemption classification, labels), which turns a few per-cloud calls
into the whole interface.
"""

from __future__ import annotations

import builtins
import logging
import re
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from infra.providers.errors import ZoneUnavailable
from infra.traces import PoissonLifetimes, TraceSchedule, load_trace

log = logging.getLogger(__name__)

CapacityClass = Literal["reserved", "ondemand", "spot"]
StopReason = Literal["preempted", "preempted_silent", "scaled_down"]
"""Why the provider (or its caller) stopped an instance."""
TerminationReason = Literal["preempted", "preempted_silent", "scaled_down", "finished", "crashed"]
"""Why an instance ended: stopped (above), or its process exited by itself (0: finished, else crashed)."""
InstanceState = Literal["running", "terminating", "terminated"]

POISSON_HORIZON_CYCLES = 1000
"""A synthetic Poisson timeline spans this many mean life+gap cycles, then loops."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class TraceAvailability(_Spec):
    """Replay a recorded availability trace (see `infra.traces.load_trace`)."""

    trace: str = Field(min_length=1)
    """Trace reference: `bamboo/g4dn`, `bamboo/p3`, `bamboo/gcloud/<name>`, `skynomad/h100/<zone>`,
    `spotserve/<segment>`."""
    time_compression: float = Field(1.0, gt=0)
    """Trace seconds per wall second (1440 replays a day in a minute); also divides `notice_s` locally."""
    offset_s: float = Field(0.0, ge=0)
    """Trace time (seconds) at which the replay starts."""
    loop: bool = True
    """Wrap around at the trace's end (else its last capacity holds)."""

    def schedule(self, max_size: int) -> TraceSchedule:
        """The pool's capacity schedule for `max_size` instances."""
        return TraceSchedule(load_trace(self.trace), max_size, self.time_compression, self.offset_s, self.loop)


class PoissonParams(_Spec):
    """Exponential instance lifetimes and gaps (calibrate from `infra.traces.summarize`)."""

    mean_life_s: float = Field(gt=0)
    """Mean time an instance slot stays available, in seconds before compression."""
    mean_gap_s: float = Field(gt=0)
    """Mean time a preempted slot stays unavailable, in seconds before compression."""
    seed: int = 0
    """Seed of the synthetic timeline."""


class PoissonAvailability(_Spec):
    """Synthetic availability: every slot alternates exponential lifetimes and gaps."""

    poisson: PoissonParams
    """The lifetime and gap model."""
    time_compression: float = Field(1.0, gt=0)
    """Model seconds per wall second; also divides `notice_s` locally."""

    def schedule(self, max_size: int) -> TraceSchedule:
        """The pool's capacity schedule for `max_size` instances."""
        p = self.poisson
        model = PoissonLifetimes(p.mean_life_s, p.mean_gap_s, p.seed)
        horizon = POISSON_HORIZON_CYCLES * (p.mean_life_s + p.mean_gap_s)
        return TraceSchedule(model.trace(max_size, horizon), max_size, self.time_compression)


class GcpPoolSettings(_Spec):
    """Where and how a `gcp` pool creates its Compute Engine VMs."""

    project: str = Field(pattern=r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
    """Google Cloud project id that owns (and pays for) the VMs."""
    zones: tuple[str, ...] = Field(min_length=1)
    """Zones in failover order, e.g. `[us-central1-a, us-central1-b]`: instances go to the first zone
    that has capacity; a zone out of capacity (or a region out of quota) is retried after a back-off."""
    image: str = Field(min_length=1)
    """Boot disk image, e.g. `projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570`
    (it needs Python 3.11+, and the GPU driver when `accelerator_type` is set)."""
    accelerator_type: str | None = None
    """GPU to attach, e.g. `nvidia-l4` or `nvidia-tesla-t4` (none for machine types with built-in
    GPUs such as `g2-*` and `a2-*`)."""
    accelerator_count: int = Field(1, ge=1)
    """GPUs of `accelerator_type` per instance."""
    service_account: str | None = None
    """Service account e-mail the VMs run as (None: the project's default compute service account)."""
    boot_disk_gb: int = Field(100, ge=10)
    """Boot disk size in GB."""
    boot_disk_type: str = "pd-balanced"
    """Boot disk type (`pd-balanced`, `pd-ssd`, `hyperdisk-balanced`, ...)."""
    network: str = "global/networks/default"
    """VPC network of the VMs."""
    subnetwork: str | None = None
    """Subnetwork, e.g. `regions/us-central1/subnetworks/rollout` (None: the network's auto subnet)."""
    external_ip: bool = True
    """Give each VM an ephemeral public IP (needed to install the project unless the subnet has Cloud NAT)."""

    @model_validator(mode="after")
    def _zones_look_like_zones(self) -> Self:
        bad = [zone for zone in self.zones if not _GCP_ZONE.match(zone)]
        if bad:
            raise ValueError(f"not GCP zones: {bad} (expected e.g. `us-central1-a`)")
        return self


class AzurePoolSettings(_Spec):
    """Where and how an `azure` pool creates its virtual machines."""

    subscription_id: str = Field(pattern=r"^[0-9a-fA-F]{8}-([0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$")
    """Azure subscription id that owns (and pays for) the VMs."""
    resource_group: str = Field(min_length=1, max_length=90)
    """Resource group the VMs are created in (it must exist)."""
    zones: tuple[str, ...] = Field(min_length=1)
    """Locations in failover order, each `<location>-<zone>` (e.g. `eastus-1`) or a bare `<location>`
    for a regional VM: instances go to the first one with capacity; one out of capacity (or a region
    out of quota) is retried after a back-off."""
    image: str = Field(min_length=1)
    """Image URN `publisher:offer:sku:version` (e.g. `microsoft-dsvm:ubuntu-hpc:2204:latest`) or the
    resource id of a custom image (it needs Python 3.11+ and, on GPU sizes, the driver)."""
    subnet_id: str = Field(pattern=r"^/subscriptions/.+/subnets/[^/]+$")
    """Resource id of the subnet the VMs' network interfaces join (in the VMs' region)."""
    ssh_public_key: str = Field(min_length=1)
    """Public key for `admin_username` (Azure requires one for Linux VMs without a password)."""
    admin_username: str = "rlboost"
    """Login user created on each VM."""
    os_disk_gb: int = Field(128, ge=30)
    """OS disk size in GB."""

    @model_validator(mode="after")
    def _zones_and_image_are_well_formed(self) -> Self:
        bad = [zone for zone in self.zones if not _AZURE_ZONE.match(zone)]
        if bad:
            raise ValueError(f"not Azure locations: {bad} (expected e.g. `eastus-1` or `westeurope`)")
        if not self.image.startswith("/subscriptions/") and len(self.image.split(":")) != 4:
            raise ValueError(f"image {self.image!r} is neither `publisher:offer:sku:version` nor an image resource id")
        return self


_GCP_ZONE = re.compile(r"^[a-z]+-[a-z]+\d+-[a-z]$")
_AZURE_ZONE = re.compile(r"^[a-z][a-z0-9]*(-[1-9])?$")
CLOUD_POOL_NAME_MAX = 50
"""Longest cloud pool name: VM names are `<pool>-<8 hex digits>`, and GCE allows 63 characters."""
_REQUIRED_CLOUD_SETTINGS: dict[str, dict[str, str]] = {
    "gcp": {
        "project": "set it to the id of the Google Cloud project that owns the VMs (`gcloud config get-value project`)",
        "zones": "list at least one zone, in failover order, e.g. `zones: [us-central1-a, us-central1-b]`",
        "image": "set the boot image, e.g. `projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570`",
    },
    "azure": {
        "subscription_id": "set it to the id of the Azure subscription that owns the VMs (`az account show --query id`)",
        "resource_group": "name the (existing) resource group the VMs go into",
        "zones": "list at least one location, in failover order, e.g. `zones: [eastus-1, eastus-2]`",
        "image": "set an image URN, e.g. `microsoft-dsvm:ubuntu-hpc:2204:latest`",
        "subnet_id": "set the resource id of the subnet for the VMs (`az network vnet subnet show ... --query id`)",
        "ssh_public_key": "paste a public key, e.g. the contents of `~/.ssh/id_ed25519.pub`",
    },
}
"""Settings whose absence gets a message naming the pool and the fix (before field validation)."""


class PoolSpec(_Spec):
    """One pool of interchangeable instances."""

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
    """Pool name (lowercase letters, digits, dashes; cloud pools start with a letter); instance ids
    are `<name>-<n>` locally, `<name>-<8 hex digits>` in a cloud."""
    provider: Literal["local", "gcp", "azure"] = "local"
    """Who runs the instances: `local` (process groups on this machine), `gcp` (Compute Engine VMs,
    settings under `gcp`) or `azure` (Azure VMs, settings under `azure`)."""
    capacity_class: CapacityClass
    """`reserved` (never preempted), `ondemand` or `spot` (cloud pools: Spot VMs)."""
    size: int = Field(ge=1)
    """Most instances the pool may hold (its target when fully launched)."""
    min_size: int = Field(0, ge=0)
    """Fewest instances the capacity manager keeps while the price is under `max_price_per_hour`."""
    machine_type: str = Field(min_length=1)
    """The cloud machine type, e.g. `g2-standard-8` (GCP) or `Standard_NC4as_T4_v3` (Azure); a local
    pool only stands for it (priced and recorded)."""
    price_per_hour: float = Field(ge=0)
    """Price of one instance-hour in USD; for a cloud pool the offline fallback used when neither the
    cloud's live price nor the bundled catalog (`infra.pricing`) knows the machine type."""
    max_price_per_hour: float | None = Field(None, gt=0)
    """Never pay more per instance-hour: above it the capacity manager gives the pool no instances;
    Azure also evicts Spot VMs when the spot price rises above it. None: no cap."""
    notice_s: float = Field(30.0, ge=0)
    """Preemption notice (SIGTERM -> SIGKILL), seconds: GCP 30, Azure 30, AWS 120. Local pools divide
    it by the availability's `time_compression`."""
    silent_kill_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of preemptions that are a SIGKILL with no notice (local pools)."""
    availability: TraceAvailability | PoissonAvailability | None = None
    """When capacity comes and goes (local pools): `{trace: ...}`, `{poisson: {...}}`, or none
    (never preempted)."""
    gcp: GcpPoolSettings | None = None
    """Compute Engine settings; required when `provider: gcp`."""
    azure: AzurePoolSettings | None = None
    """Azure settings; required when `provider: azure`."""

    @model_validator(mode="before")
    @classmethod
    def _cloud_settings_are_complete(cls, data: Any) -> Any:
        """Name the pool and the fix when a cloud section or one of its essential keys is missing."""
        if not isinstance(data, dict):
            return data
        name, provider = data.get("name", "?"), data.get("provider", "local")
        for cloud, required in _REQUIRED_CLOUD_SETTINGS.items():
            section = data.get(cloud)
            if provider != cloud:
                if section is not None:
                    raise ValueError(f"pool {name!r}: a `{cloud}` section needs `provider: {cloud}` (it has {provider})")
                continue
            if section is None:
                raise ValueError(f"pool {name!r}: `provider: {cloud}` needs a `{cloud}` section with {', '.join(required)}")
            if isinstance(section, dict):
                for key, fix in required.items():
                    if not section.get(key):
                        raise ValueError(f"pool {name!r}: {cloud}.{key} is missing or empty: {fix}")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.capacity_class == "reserved" and self.availability is not None:
            raise ValueError("a reserved pool is never preempted: remove `availability`")
        if self.min_size > self.size:
            raise ValueError(f"pool {self.name!r}: min_size {self.min_size} exceeds size {self.size}")
        if self.provider != "local":
            if self.availability is not None or self.silent_kill_fraction:
                raise ValueError(
                    f"pool {self.name!r}: `availability` and `silent_kill_fraction` simulate preemptions of local "
                    f"pools; {self.provider} preempts its own instances: remove them"
                )
            if not self.name[0].isalpha() or len(self.name) > CLOUD_POOL_NAME_MAX:
                raise ValueError(
                    f"pool {self.name!r}: a cloud pool's name prefixes its VM names: start it with a letter and "
                    f"keep it to {CLOUD_POOL_NAME_MAX} characters"
                )
        return self

    def schedule(self) -> TraceSchedule | None:
        """The capacity schedule of this pool, or None if its capacity never changes."""
        return None if self.availability is None else self.availability.schedule(self.size)

    @property
    def zones(self) -> tuple[str, ...]:
        """The cloud zones (or Azure locations) in failover order; empty for a local pool."""
        settings = self.gcp or self.azure
        return settings.zones if settings else ()


@dataclass(frozen=True)
class InstanceHandle:
    """One launched instance, as its launcher knows it."""

    instance_id: str
    pool: str
    capacity_class: CapacityClass
    machine_type: str
    price_per_hour: float
    launched_at: float
    """Provider clock (epoch seconds by default) when the instance was started."""


@dataclass(frozen=True)
class InstanceRecord(InstanceHandle):
    """An instance with its lifecycle so far (the cost ledger's input)."""

    state: InstanceState = "running"
    notice_at: float | None = None
    """When the instance was told to stop (SIGTERM, or the SIGKILL of a silent preemption)."""
    terminated_at: float | None = None
    reason: TerminationReason | None = None
    exit_code: int | None = None
    """Process exit status; negative: killed by that signal (-9: SIGKILL)."""
    zone: str | None = None
    """Cloud zone (Azure: location[-zone]) the instance runs in; None for a local instance."""
    launch_step: int | None = None
    """RL step during which a cloud instance was launched (its `rlboost-step` label)."""


@dataclass(frozen=True)
class PreemptionEvent:
    """An instance that the provider took back: notified at `at`, killed by `kill_at`."""

    instance_id: str
    pool: str
    at: float
    kill_at: float
    silent: bool
    """True when there was no notice (SIGKILL at once)."""


class Provider(ABC):
    """Launches, lists and stops instances of pools; reports preemptions and prices."""

    @abstractmethod
    def launch(self, pool: PoolSpec, count: int) -> builtins.list[InstanceHandle]:
        """Ask for `count` more instances of `pool`; returns those started now."""

    @abstractmethod
    def list(self, live_only: bool = False) -> builtins.list[InstanceRecord]:
        """Every instance launched so far (or only those not yet terminated)."""

    @abstractmethod
    def describe(self, instance_id: str) -> InstanceRecord:
        """One instance's record; `KeyError` if unknown."""

    @abstractmethod
    def terminate(self, instance_id: str, reason: StopReason = "scaled_down") -> None:
        """Stop an instance (notice, then kill); a no-op if it is already stopping or gone."""

    @abstractmethod
    def preemptions(self) -> builtins.list[PreemptionEvent]:
        """Preemptions since the previous call."""

    @abstractmethod
    def quote(self, pool: PoolSpec) -> float:
        """Current price of one instance-hour of `pool`, USD."""

    def refresh(self, pools: Sequence[PoolSpec] = ()) -> None:
        """Bring `list()` and `preemptions()` up to date with what happened outside this process
        (a cloud preempting VMs), also looking for instances of `pools` left by an earlier
        controller. Providers that observe their instances directly (local) have nothing to do."""


# -- shared by the cloud providers ----------------------------------------------------------------

LABEL_RUN = "rlboost-run"
LABEL_POOL = "rlboost-pool"
LABEL_STEP = "rlboost-step"
LABEL_VALUE_MAX = 63
"""GCP's limit on label values (Azure tags allow 256)."""

OnChange = Callable[[InstanceRecord], None]
"""Called with an instance's new record after every lifecycle change (launch, notice, end)."""


class BootHooks(Protocol):
    """What must exist before a cloud instance boots (the Prefect flow run its worker picks up),
    and its undoing when the instance is never created."""

    def before_boot(self, pool: PoolSpec, instance_id: str) -> None:
        """Prepare the work of an instance about to be created; an error here creates no VM."""

    def never_booted(self, instance_id: str, why: str) -> None:
        """Undo `before_boot` for an instance the cloud did not create."""


def instance_work_queue(run_id: str, instance_id: str) -> str:
    """The Prefect work queue of an instance's `rollout-instance` flow run, polled by that
    instance's worker only."""
    return f"{run_id}-{instance_id}"


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


class ZoneFailover:
    """The zones of one pool to try, in order, skipping those in back-off after a failure.

    A zone that failed `k` times in a row is skipped for `min(backoff_s * 2**(k-1), max_backoff_s)`;
    a quota failure blocks every zone of its region (quotas are regional). A success resets the count.
    """

    def __init__(self, zones: Sequence[str], region_of: Callable[[str], str], backoff_s: float, max_backoff_s: float) -> None:
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
        self._events: builtins.list[PreemptionEvent] = []
        self._lock = threading.Lock()

    # -- per cloud ------------------------------------------------------------------------------

    @abstractmethod
    def _create(
        self, pool: PoolSpec, zone: str, names: Sequence[str], labels: dict[str, str]
    ) -> tuple[builtins.list[str], ZoneUnavailable | None]:
        """Create one VM per name in `zone` and wait until each is created or has failed; returns
        the names created and, unless that is all of them, why the zone could not take the others."""

    @abstractmethod
    def _delete(self, pool: PoolSpec, zone: str, name: str) -> None:
        """Start deleting a VM (without waiting); a VM already gone is no error."""

    @abstractmethod
    def _observe(self, pool: PoolSpec) -> builtins.list[ObservedInstance]:
        """The run's VMs of `pool` that exist now, in any of its zones."""

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

    def launch(self, pool: PoolSpec, count: int) -> builtins.list[InstanceHandle]:
        self._register(pool)
        with self._lock:
            running = sum(1 for r in self._records.values() if r.pool == pool.name and r.state == "running")
        if count < 0 or running + count > pool.size:
            raise ValueError(f"pool {pool.name}: {running} running + {count} exceeds size {pool.size}")
        failover = self._failover[pool.name]
        started: builtins.list[InstanceHandle] = []
        while len(started) < count:
            zones = failover.candidates(self._clock())
            if not zones:
                log.warning("pool %s: started %d of %d instances; every zone is backing off", pool.name, len(started), count)
                break
            zone = zones[0]
            price = self._quote_zone(pool, zone)
            step = self._current_step()
            names = [f"{pool.name}-{uuid.uuid4().hex[:8]}" for _ in range(count - len(started))]
            if self._boot_hooks is not None:
                for name in names:
                    self._boot_hooks.before_boot(pool, name)
            try:
                created, failure = self._create(pool, zone, names, instance_labels(self.run_id, pool.name, step))
            except BaseException as error:
                self._never_booted(names, f"was not created: {error}")
                raise
            self._never_booted([n for n in names if n not in created], f"was not created: {failure}")
            now = self._clock()
            for name in created:
                record = InstanceRecord(
                    name, pool.name, pool.capacity_class, pool.machine_type, price,
                    launched_at=now, zone=zone, launch_step=step,
                )
                self._update(record)
                started.append(record)
            if failure is None:
                failover.succeeded(zone)
            else:
                until = failover.failed(failure, now)
                log.warning("pool %s: %s; backing off there for %.0f s", pool.name, failure, until - now)
        return started

    def list(self, live_only: bool = False) -> builtins.list[InstanceRecord]:
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
        if reason != "scaled_down":
            silent = reason == "preempted_silent"
            self._emit(PreemptionEvent(instance_id, pool.name, now, now if silent else now + pool.notice_s, silent))
        self._update(replace(record, state="terminating", notice_at=now, reason=reason))

    def preemptions(self) -> builtins.list[PreemptionEvent]:
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
        for pool in builtins.list(self._pools.values()):
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
        live = [r for r in self.list(live_only=True) if r.pool == pool.name]
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
        known = {r.instance_id for r in self.list()}
        for seen in observed.values():
            if seen.name not in known and seen.status == "running":
                log.info("pool %s: adopting %s in %s (launched by an earlier controller)", pool.name, seen.name, seen.zone)
                self._update(InstanceRecord(
                    seen.name, pool.name, pool.capacity_class, pool.machine_type, self._quote_zone(pool, seen.zone),
                    launched_at=now if seen.created_at is None else seen.created_at,
                    zone=seen.zone, launch_step=seen.launch_step,
                ))

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
