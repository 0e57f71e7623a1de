"""Google Cloud pools: Compute Engine Spot VMs through `google-cloud-compute` (REST transport).

`GcpProvider` implements `ZonalCloudProvider`'s per-cloud calls:
- create: `instances.insert_unary` of a VM with `scheduling.provisioning_model=SPOT` (spot pools),
  `instance_termination_action=DELETE`, the pool's GPUs, a boot disk from its image, its service
  account, the run/pool/step labels and `infra.providers.startup`'s boot script; the zone operation
  is polled here (a `ZoneOperationsClient` of the same client options; `.result()` would poll Google
  itself). `ZONE_RESOURCE_POOL_EXHAUSTED` backs the zone off, `QUOTA_EXCEEDED` its whole region;
- observe: `instances.list` filtered on the run and pool labels, per zone; a lost VM was preempted
  when its zone has a `compute.instances.preempted` operation for it; `labelled` serves the sweep;
- prices: the Cloud Billing Catalog for the machine type's shape (`machineTypes.get`), else the
  offline price (`infra.providers.prices_live`).
Credentials come from google.auth's default discovery unless injected, never logged. Errors: bad
credentials or permissions -> `CredentialsError`; unknown project, machine type, image ->
`PoolConfigError`; capacity, quota, throttling -> back-off. Bring-up: docs/cloud-pools.md.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import requests
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.auth import exceptions as auth_exc
from google.auth.credentials import Credentials
from google.cloud import billing_v1, compute_v1

from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.errors import CredentialsError, PoolConfigError, ZoneUnavailable
from infra.providers.interface import BootPlan
from infra.providers.pool import PoolSpec
from infra.providers.prices_live import GceShape, GcpCatalogPrices, QuoteBook
from infra.providers.startup import render_startup_script
from infra.providers.zonal import (
    LABEL_POOL,
    LABEL_RUN,
    LABEL_STEP,
    LabelledVm,
    ObservedInstance,
    ObservedStatus,
    OperationPolling,
    ZonalCloudProvider,
    label_value,
)

log = logging.getLogger(__name__)

CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
PREEMPTED_OPERATION = "compute.instances.preempted"
CAPACITY_CODES = frozenset({"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"})
QUOTA_CODES = frozenset({"QUOTA_EXCEEDED"})
QUOTA_REASONS = frozenset({"quotaExceeded", "QUOTA_EXCEEDED"})
THROTTLE_REASONS = frozenset({"rateLimitExceeded", "userRateLimitExceeded", "RATE_LIMIT_EXCEEDED"})
STATUSES: dict[str, ObservedStatus] = {
    "PROVISIONING": "running",
    "STAGING": "running",
    "RUNNING": "running",
    "REPAIRING": "running",
    "STOPPING": "stopping",
    "SUSPENDING": "stopping",
    "TERMINATED": "stopped",
    "SUSPENDED": "stopped",
    "STOPPED": "stopped",
}
"""GCE instance status -> what it means for the pool."""
LOGIN_FIX = (
    "run `gcloud auth application-default login`, or point GOOGLE_APPLICATION_CREDENTIALS at a valid "
    "service-account key, or run on a VM whose service account may manage Compute Engine"
)


def zone_region(zone: str) -> str:
    """`us-central1-a` -> `us-central1`."""
    return zone.rsplit("-", 1)[0]


def _epoch(rfc3339: str) -> float | None:
    return datetime.fromisoformat(rfc3339).timestamp() if rfc3339 else None


class GcpProvider(ZonalCloudProvider):
    """Spot (or standard) Compute Engine VMs for `gcp` pools."""

    provider_name = "gcp"

    def __init__(
        self,
        *,
        run_id: str,
        bootstrap: WorkerBootstrap,
        live_prices: bool,
        credentials: Credentials | None = None,
        client_options: ClientOptions | None = None,
        billing_client_options: ClientOptions | None = None,
        polling: OperationPolling = OperationPolling(),
        price_ttl_s: float = 3600.0,
        sleep: Callable[[float], None] = time.sleep,
        **common: Any,
    ) -> None:
        """`credentials` and `client_options` (e.g. a local `api_endpoint`) go to every Compute
        Engine client, `billing_client_options` to the Cloud Billing Catalog client; None means the
        SDK's defaults (google.auth default credentials, Google's endpoints). `live_prices`
        (`fabric.cloud.live_prices`) False quotes offline prices only. `common`: see `ZonalCloudProvider`."""
        super().__init__(run_id=run_id, **common)
        self._bootstrap = bootstrap
        self._credentials = credentials
        self._client_options = client_options
        self._billing_client_options = billing_client_options
        self._live_prices = live_prices
        self._polling = polling
        self._sleep = sleep
        self._clients: dict[str, Any] = {}
        self._shapes: dict[tuple[str, str], GceShape] = {}
        self._quotes = QuoteBook(clock=self._clock, ttl_s=price_ttl_s)
        self._catalog: GcpCatalogPrices | None = None

    # -- clients --------------------------------------------------------------------------------

    def _client(self, pool: PoolSpec, kind: type) -> Any:
        """One client of each kind, built on first use (credential discovery happens there)."""
        name = kind.__name__
        if name not in self._clients:
            options = self._billing_client_options if kind is billing_v1.CloudCatalogClient else self._client_options
            with self._translate(pool, None):
                self._clients[name] = kind(credentials=self._credentials, client_options=options, transport="rest")
        return self._clients[name]

    @contextmanager
    def _translate(self, pool: PoolSpec, zone: str | None) -> Iterator[None]:
        """Google errors -> `CredentialsError`, `PoolConfigError`, or (in a zone) `ZoneUnavailable`."""
        project = pool.gcp.project if pool.gcp else "?"
        try:
            yield
        except auth_exc.DefaultCredentialsError:
            raise CredentialsError(pool.name, f"no Google Cloud credentials found: {LOGIN_FIX}") from None
        except auth_exc.RefreshError as error:
            reason = error.args[0] if error.args and isinstance(error.args[0], str) else type(error).__name__
            raise CredentialsError(
                pool.name,
                f"the Google Cloud credentials could not be refreshed ({reason}); they have expired "
                f"or been revoked: {LOGIN_FIX}",
            ) from None
        except (requests.ConnectionError, requests.Timeout) as error:
            if zone is None:
                raise
            raise ZoneUnavailable(zone, "transient", f"{type(error).__name__}: {error}") from None
        except gexc.Unauthorized as error:
            raise CredentialsError(
                pool.name, f"Google Cloud rejected the credentials ({error.message}): {LOGIN_FIX}"
            ) from None
        except gexc.GoogleAPICallError as error:
            reasons = {item.get("reason") for item in error.errors if isinstance(item, dict)} | {error.reason}
            detail = f"{error.code} {error.message}"
            if zone is not None and reasons & QUOTA_REASONS:
                raise ZoneUnavailable(zone, "quota", detail) from None
            if zone is not None and (reasons & THROTTLE_REASONS or isinstance(error, _TRANSIENT)):
                raise ZoneUnavailable(zone, "transient", detail) from None
            if isinstance(error, gexc.Forbidden):
                raise CredentialsError(
                    pool.name,
                    f"permission denied in project {project} ({error.message}): grant the account "
                    "roles/compute.instanceAdmin.v1 (and roles/iam.serviceAccountUser on the VMs' service account)",
                ) from None
            if isinstance(error, gexc.NotFound):
                raise PoolConfigError(
                    pool.name,
                    f"not found ({error.message}): check gcp.project ({project}), gcp.zones, gcp.image "
                    "and gcp.accelerator_type, and that the Compute Engine API is enabled in the project",
                ) from None
            if isinstance(error, gexc.BadRequest):
                raise PoolConfigError(
                    pool.name, f"Compute Engine refused the VM ({error.message}): {_fix_for(error.message)}"
                ) from None
            raise

    # -- ZonalCloudProvider ---------------------------------------------------------------------

    def _create(
        self, pool: PoolSpec, zone: str, names: Sequence[str], labels: dict[str, str], plans: dict[str, BootPlan]
    ) -> tuple[list[str], ZoneUnavailable | None]:
        instances = self._client(pool, compute_v1.InstancesClient)
        assert pool.gcp is not None
        pending: list[tuple[str, compute_v1.Operation]] = []
        failure: ZoneUnavailable | None = None
        for name in names:
            request = compute_v1.InsertInstanceRequest(
                project=pool.gcp.project,
                zone=zone,
                request_id=str(uuid.uuid4()),
                instance_resource=self.instance_resource(pool, zone, name, labels, plans[name]),
            )
            try:
                with self._translate(pool, zone):
                    pending.append(
                        (name, instances.insert_unary(request=request, timeout=self._polling.request_timeout_s))
                    )
            except ZoneUnavailable as error:
                failure = error
                break
        created = []
        for name, operation in pending:
            error = self._wait(pool, zone, operation)
            if error is None:
                created.append(name)
            else:
                failure = failure or error
        return created, failure

    def instance_resource(
        self, pool: PoolSpec, zone: str, name: str, labels: dict[str, str], plan: BootPlan = BootPlan()
    ) -> compute_v1.Instance:
        """The VM one `insert` asks for, booting with `plan`."""
        settings = pool.gcp
        assert settings is not None
        spot = pool.capacity_class == "spot"
        scheduling = compute_v1.Scheduling(
            provisioning_model="SPOT" if spot else "STANDARD",
            automatic_restart=not spot,
            on_host_maintenance="TERMINATE",  # GPUs cannot live-migrate; spot VMs must not
        )
        if spot:
            scheduling.instance_termination_action = "DELETE"
        network = compute_v1.NetworkInterface(network=settings.network)
        if settings.subnetwork:
            network.subnetwork = settings.subnetwork
        if settings.external_ip:
            network.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
        script = render_startup_script(
            self._bootstrap, pool=pool, instance_id=name, run_id=self.run_id, watcher="gce", plan=plan
        )
        instance = compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{pool.machine_type}",
            scheduling=scheduling,
            labels=labels,
            disks=[
                compute_v1.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    initialize_params=compute_v1.AttachedDiskInitializeParams(
                        source_image=settings.image,
                        disk_size_gb=settings.boot_disk_gb,
                        disk_type=f"zones/{zone}/diskTypes/{settings.boot_disk_type}",
                    ),
                )
            ],
            network_interfaces=[network],
            service_accounts=[
                compute_v1.ServiceAccount(
                    email=settings.service_account or "default",
                    scopes=[CLOUD_PLATFORM_SCOPE],
                )
            ],
            metadata=compute_v1.Metadata(items=[compute_v1.Items(key="startup-script", value=script)]),
        )
        if settings.accelerator_type:
            instance.guest_accelerators = [
                compute_v1.AcceleratorConfig(
                    accelerator_type=f"zones/{zone}/acceleratorTypes/{settings.accelerator_type}",
                    accelerator_count=settings.accelerator_count,
                )
            ]
        return instance

    def _wait(self, pool: PoolSpec, zone: str, operation: compute_v1.Operation) -> ZoneUnavailable | None:
        """Poll the zone operation until DONE; its error as a zone failure, or None."""
        assert pool.gcp is not None
        operations = self._client(pool, compute_v1.ZoneOperationsClient)
        deadline = time.monotonic() + self._polling.timeout_s
        while operation.status != compute_v1.Operation.Status.DONE:
            if time.monotonic() > deadline:
                return ZoneUnavailable(
                    zone, "transient", f"operation {operation.name} still running after {self._polling.timeout_s:.0f} s"
                )
            self._sleep(self._polling.interval_s)
            with self._translate(pool, None):
                operation = operations.wait(
                    project=pool.gcp.project,
                    zone=zone,
                    operation=operation.name,
                    timeout=self._polling.request_timeout_s,
                )
        errors = list(operation.error.errors) if operation.error else []
        if not errors:
            return None
        codes = {e.code for e in errors}
        detail = "; ".join(f"{e.code}: {e.message}" for e in errors)
        kind = "capacity" if codes & CAPACITY_CODES else "quota" if codes & QUOTA_CODES else "transient"
        return ZoneUnavailable(zone, kind, detail)

    def _delete(self, pool: PoolSpec, zone: str, name: str) -> None:
        assert pool.gcp is not None
        request = compute_v1.DeleteInstanceRequest(
            project=pool.gcp.project, zone=zone, instance=name, request_id=str(uuid.uuid4())
        )
        with self._translate(pool, None):
            try:
                self._client(pool, compute_v1.InstancesClient).delete_unary(
                    request=request, timeout=self._polling.request_timeout_s
                )
            except gexc.NotFound:
                log.info("pool %s: %s in %s is already gone", pool.name, name, zone)

    def _observe(self, pool: PoolSpec) -> list[ObservedInstance]:
        assert pool.gcp is not None
        instances = self._client(pool, compute_v1.InstancesClient)
        wanted = (
            f'(labels.{LABEL_RUN} = "{label_value(self.run_id)}") (labels.{LABEL_POOL} = "{label_value(pool.name)}")'
        )
        seen = []
        for zone in pool.zones:
            request = compute_v1.ListInstancesRequest(project=pool.gcp.project, zone=zone, filter=wanted)
            with self._translate(pool, None):
                listed = list(instances.list(request=request, timeout=self._polling.request_timeout_s))
            for vm in listed:
                step = vm.labels.get(LABEL_STEP, "")
                seen.append(
                    ObservedInstance(
                        vm.name,
                        pool.name,
                        zone,
                        STATUSES.get(vm.status, "running"),
                        created_at=_epoch(vm.creation_timestamp),
                        launch_step=int(step) if step.isdigit() else None,
                    )
                )
        return seen

    def labelled(self, pool: PoolSpec) -> list[LabelledVm]:
        assert pool.gcp is not None
        instances = self._client(pool, compute_v1.InstancesClient)
        found = []
        for zone in pool.zones:
            request = compute_v1.ListInstancesRequest(
                project=pool.gcp.project, zone=zone, filter=f"labels.{LABEL_RUN}:*"
            )
            with self._translate(pool, None):
                listed = list(instances.list(request=request, timeout=self._polling.request_timeout_s))
            found += [
                LabelledVm(
                    self.provider_name,
                    vm.name,
                    zone,
                    vm.labels[LABEL_RUN],
                    vm.labels.get(LABEL_POOL, ""),
                    STATUSES.get(vm.status, "running"),
                    _epoch(vm.creation_timestamp),
                    pool,
                )
                for vm in listed
            ]
        return found

    def _notice_times(self, pool: PoolSpec, zone: str, names: Sequence[str], now: float) -> dict[str, float]:
        assert pool.gcp is not None
        request = compute_v1.ListZoneOperationsRequest(
            project=pool.gcp.project, zone=zone, filter=f'operationType = "{PREEMPTED_OPERATION}"'
        )
        with self._translate(pool, None):
            operations = list(
                self._client(pool, compute_v1.ZoneOperationsClient).list(
                    request=request, timeout=self._polling.request_timeout_s
                )
            )
        wanted = set(names)
        notices = {}
        for operation in operations:
            name = operation.target_link.rsplit("/", 1)[-1]
            if name in wanted:
                notices[name] = _epoch(operation.insert_time) or now
        return notices

    def _region(self, zone: str) -> str:
        return zone_region(zone)

    def _quote_zone(self, pool: PoolSpec, zone: str) -> float:
        live = (lambda: self._live_price(pool, zone)) if self._live_prices else None
        return self._quotes.quote(pool, zone, live)

    def _live_price(self, pool: PoolSpec, zone: str) -> float:
        if self._catalog is None:
            client = self._client(pool, billing_v1.CloudCatalogClient)
            self._catalog = GcpCatalogPrices(client, clock=self._clock, timeout_s=self._polling.request_timeout_s)
        return self._catalog.hourly_price(
            zone_region(zone), self.machine_shape(pool, zone), pool.capacity_class == "spot"
        )

    def machine_shape(self, pool: PoolSpec, zone: str) -> GceShape:
        """vCPUs, memory and GPUs of the pool's machine type in `zone` (its own GPUs plus the pool's)."""
        key = (pool.name, zone)
        if key not in self._shapes:
            assert pool.gcp is not None
            client = self._client(pool, compute_v1.MachineTypesClient)
            with self._translate(pool, None):
                try:
                    machine = client.get(
                        project=pool.gcp.project,
                        zone=zone,
                        machine_type=pool.machine_type,
                        timeout=self._polling.request_timeout_s,
                    )
                except gexc.NotFound:
                    raise PoolConfigError(
                        pool.name,
                        f"machine type {pool.machine_type!r} does not exist in zone {zone} of project "
                        f"{pool.gcp.project}: pick one that every zone of the pool offers "
                        f"(`gcloud compute machine-types list --zones {zone}`), and check gcp.project and gcp.zones",
                    ) from None
            accelerators = [(a.guest_accelerator_type, a.guest_accelerator_count) for a in machine.accelerators]
            if pool.gcp.accelerator_type:
                accelerators.append((pool.gcp.accelerator_type, pool.gcp.accelerator_count))
            self._shapes[key] = GceShape(
                pool.machine_type.split("-", 1)[0], machine.guest_cpus, machine.memory_mb / 1024, tuple(accelerators)
            )
        return self._shapes[key]


_TRANSIENT = (gexc.TooManyRequests, gexc.InternalServerError, gexc.ServiceUnavailable, gexc.GatewayTimeout)


def _fix_for(message: str) -> str:
    """What to change, from the field Compute Engine names in a 400."""
    if "machineType" in message:
        return "set machine_type to a type every zone of the pool offers (`gcloud compute machine-types list --zones ZONE`)"
    if "acceleratorType" in message or "guestAccelerators" in message:
        return "set gcp.accelerator_type to a GPU every zone offers (`gcloud compute accelerator-types list`)"
    if "sourceImage" in message or "image" in message:
        return "set gcp.image to an image you can read (`gcloud compute images list`)"
    return "check the pool's gcp settings against the message"
