"""The pool schema of a run configuration: `PoolSpec` and its availability and cloud settings.

A **pool** (`PoolSpec`) is one kind of capacity (provider, machine type, capacity class) with a
price, a preemption notice period and, for the clouds, where and how to create its instances
(`GcpPoolSettings`, `AzurePoolSettings`); local pools may be preempted by a recorded trace or a
Poisson schedule (`TraceAvailability`, `PoissonAvailability`).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from infra.availability.capacity import CapacityClass
from infra.availability.traces import PoissonLifetimes, TraceSchedule, load_trace
from rl.engine_spec import EngineSpec

POISSON_HORIZON_CYCLES = 1000
"""A synthetic Poisson timeline spans this many mean life+gap cycles, then loops."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)


class TraceAvailability(_Spec):
    """Replay a recorded availability trace (see `infra.availability.traces.load_trace`)."""

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
    """Exponential instance lifetimes and gaps (calibrate from `infra.availability.traces.summarize`)."""

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
    identity: str | None = Field(None, pattern=r"^/subscriptions/.+/userAssignedIdentities/[^/]+$")
    """Resource id of a user-assigned managed identity the VMs run as: it reads the weight store
    (give it Storage Blob Data Reader on the store's container). None: no identity."""

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
GCP_GPU_FAMILIES = frozenset({"a2", "a3", "a4", "g2", "g4"})
"""Compute Engine machine families with built-in GPUs (other types get them as `accelerator_type`)."""
_AZURE_GPU_TYPE = re.compile(r"^Standard_N[CDV]", re.IGNORECASE)
"""Azure's GPU sizes: the N-series (NC, ND, NV)."""
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
    engine: Literal["hf", "vllm"] | None = None
    """Generation backend of this pool's instances (None: the run's `rollout.engine`)."""
    device: str | None = None
    """Device of this pool's engines, e.g. `cpu` or `cuda` (None: the run's `rollout.device`)."""
    gpus_per_instance: float = Field(0.0, ge=0)
    """GPUs each instance holds. A whole number (1, 2, ...) gives every instance GPUs of its own
    (`CUDA_VISIBLE_DEVICES`) and a vLLM engine that tensor-parallel size; a share below 1 (e.g.
    0.5) puts instances on one GPU while their shares add up to at most 1, each vLLM engine taking
    that share of `rollout.vllm.gpu_memory_utilization`. A local pool's instances are placed on
    `fabric.node_gpus`, the in-process `colocated` one on the first (the trainer's); a cloud VM has its
    machine type's. 0: no placement (the instance sees every GPU of its machine)."""
    colocated: bool = False
    """Run the instance inside the training process, on the trainer's device (`auto`: the trainer's),
    instead of as a process of its own: it takes each version from the trainer directly and, once it
    releases its samples at `T_local`, frees its engine's memory (`GenerationEngine.sleep`) until
    the next step. Only for a `reserved`, `local` pool of size 1."""
    gcp: GcpPoolSettings | None = None
    """Compute Engine settings; required when `provider: gcp`."""
    azure: AzurePoolSettings | None = None
    """Azure settings; required when `provider: azure`."""

    @property
    def has_gpus(self) -> bool:
        """Whether the pool's machine type comes with GPUs (a cloud pool; a local one stands for a type)."""
        if self.provider == "gcp":
            attached = self.gcp is not None and self.gcp.accelerator_type is not None
            return attached or self.machine_type.split("-", 1)[0] in GCP_GPU_FAMILIES
        if self.provider == "azure":
            return bool(_AZURE_GPU_TYPE.match(self.machine_type))
        return False

    def engine_spec(self, default: EngineSpec) -> EngineSpec:
        """The engine of this pool's instances: the run's `default` with the pool's overrides; `auto`
        becomes `cuda` on a cloud machine type with GPUs (a missing driver then fails the instance
        instead of decoding on its CPU)."""
        device = self.device or default.device
        if device == "auto" and self.has_gpus:
            device = "cuda"
        vllm = default.vllm
        if self.gpus_per_instance >= 1:
            vllm = vllm.model_copy(update={"tensor_parallel_size": int(self.gpus_per_instance)})
        elif self.gpus_per_instance > 0:
            share = vllm.gpu_memory_utilization * self.gpus_per_instance
            vllm = vllm.model_copy(update={"gpu_memory_utilization": share})
        return default.model_copy(update={"kind": self.engine or default.kind, "device": device, "vllm": vllm})

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
                    raise ValueError(
                        f"pool {name!r}: a `{cloud}` section needs `provider: {cloud}` (it has {provider})"
                    )
                continue
            if section is None:
                raise ValueError(
                    f"pool {name!r}: `provider: {cloud}` needs a `{cloud}` section with {', '.join(required)}"
                )
            if isinstance(section, dict):
                for key, fix in required.items():
                    if not section.get(key):
                        raise ValueError(f"pool {name!r}: {cloud}.{key} is missing or empty: {fix}")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.gpus_per_instance > 1 and not self.gpus_per_instance.is_integer():
            raise ValueError(
                f"pool {self.name!r}: gpus_per_instance {self.gpus_per_instance:g} is neither whole GPUs nor a share "
                "of one: use 1, 2, 4, ... (GPUs of its own) or a share below 1 such as 0.5"
            )
        if self.capacity_class == "reserved" and self.availability is not None:
            raise ValueError("a reserved pool is never preempted: remove `availability`")
        if self.min_size > self.size:
            raise ValueError(f"pool {self.name!r}: min_size {self.min_size} exceeds size {self.size}")
        if self.colocated:
            if self.capacity_class != "reserved" or self.provider != "local":
                raise ValueError(
                    f"pool {self.name!r}: `colocated: true` puts the instance in the training process, so the "
                    f"pool must be the training cluster's own share: set `capacity_class: reserved` and "
                    f"`provider: local` (it has {self.capacity_class}, {self.provider}), or remove `colocated`"
                )
            if self.size != 1:
                raise ValueError(
                    f"pool {self.name!r}: a colocated pool runs one instance in the training process: set `size: 1` "
                    f"(it has {self.size})"
                )
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
