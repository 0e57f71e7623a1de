"""Azure pools: Spot VMs through `azure-mgmt-compute`, credentials through `azure-identity`.

`AzureProvider` implements `ZonalCloudProvider`'s per-cloud calls:
- create: `virtual_machines.begin_create_or_update` (polled by the SDK's poller) of a VM with, for
  spot pools, `priority=Spot`, `eviction_policy=Delete` and `billing_profile.max_price` (the pool's
  `max_price_per_hour`, or -1: up to the pay-as-you-go price), the image, a NIC created with it on
  the pool's subnet, the run/pool/step tags and `infra.providers.startup`'s boot script as custom
  data. Allocation failures make the location back off (the VM is deleted), quota failures its region;
- observe: `virtual_machines.list` of the resource group, kept to the run's and pool's tags; a spot
  VM that vanishes (or starts deleting) unasked was evicted; `labelled` lists every run's VMs (sweep);
- prices: the Azure Retail Prices API, else the offline price (`infra.providers.prices_live`).
Zones are `<location>-<zone>` (`eastus-1`) or a bare `<location>`. Credentials come from
`DefaultAzureCredential` unless injected, never logged; over plain http (a local test endpoint)
pass `authentication_policy=SansIOHTTPPolicy()` (the SDK sends bearer tokens over https only).
Bring-up: docs/cloud-pools.md.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from azure.core.credentials import TokenCredential
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.core.pipeline.policies import SansIOHTTPPolicy
from azure.identity import DefaultAzureCredential
from azure.mgmt.compute import ComputeManagementClient
from azure.mgmt.compute import models as m

from infra.providers.bootstrap import WorkerBootstrap
from infra.providers.errors import CredentialsError, PoolConfigError, ZoneUnavailable
from infra.providers.interface import BootPlan
from infra.providers.pool import PoolSpec
from infra.providers.prices_live import AzureRetailPrices, QuoteBook
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

NETWORK_API_VERSION = "2020-11-01"
"""Lets the VM create (and delete) its own network interface."""
CAPACITY_CODES = frozenset(
    {
        "AllocationFailed",
        "ZonalAllocationFailed",
        "OverconstrainedAllocationRequest",
        "OverconstrainedZonalAllocationRequest",
        "SkuNotAvailable",
    }
)
QUOTA_CODES = frozenset({"QuotaExceeded", "LowPriorityQuotaExceeded"})
TRANSIENT_CODES = frozenset({"RetryableError", "InternalExecutionError", "TooManyRequests"})
CREDENTIAL_CODES = frozenset({"ExpiredAuthenticationToken", "InvalidAuthenticationToken", "AuthenticationFailed"})
NOT_FOUND_FIXES = {
    "ResourceGroupNotFound": "create the resource group (`az group create`) or fix azure.resource_group",
    "SubscriptionNotFound": "fix azure.subscription_id (`az account list --query [].id`)",
    "InvalidSubscriptionId": "fix azure.subscription_id (`az account list --query [].id`)",
}
STATES: dict[str, ObservedStatus] = {"Deleting": "stopping", "Failed": "stopped"}
"""Provisioning state -> what it means for the pool (others: running)."""
LOGIN_FIX = (
    "run `az login`, or set AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET, or give the host a managed "
    "identity (DefaultAzureCredential tries these in turn)"
)


def split_zone(zone: str) -> tuple[str, str | None]:
    """`eastus-1` -> (`eastus`, `1`); `westeurope` -> (`westeurope`, None)."""
    location, _, number = zone.partition("-")
    return location, number or None


def image_reference(image: str) -> m.ImageReference:
    """A URN `publisher:offer:sku:version` or an image resource id."""
    if image.startswith("/"):
        return m.ImageReference(id=image)
    publisher, offer, sku, version = image.split(":")
    return m.ImageReference(publisher=publisher, offer=offer, sku=sku, version=version)


class AzureProvider(ZonalCloudProvider):
    """Spot (or regular) Azure VMs for `azure` pools."""

    provider_name = "azure"

    def __init__(
        self,
        *,
        run_id: str,
        bootstrap: WorkerBootstrap,
        live_prices: bool,
        credential: TokenCredential | None = None,
        base_url: str | None = None,
        authentication_policy: SansIOHTTPPolicy | None = None,
        retail_prices: AzureRetailPrices | None = None,
        polling: OperationPolling = OperationPolling(),
        price_ttl_s: float = 3600.0,
        **common: Any,
    ) -> None:
        """`credential` (default `DefaultAzureCredential()`), `base_url` (default: Azure Resource
        Manager) and `authentication_policy` go to every `ComputeManagementClient`; `retail_prices`
        defaults to the public Retail Prices API. `live_prices` (`fabric.cloud.live_prices`) False
        quotes offline prices only.
        `common`: see `ZonalCloudProvider`."""
        super().__init__(run_id=run_id, **common)
        self._bootstrap = bootstrap
        self._credential = credential
        self._client_kwargs: dict[str, Any] = {
            "polling_interval": polling.interval_s,
            "connection_timeout": polling.request_timeout_s,
            "read_timeout": polling.request_timeout_s,
        }
        if base_url is not None:
            self._client_kwargs["base_url"] = base_url
        if authentication_policy is not None:
            self._client_kwargs["authentication_policy"] = authentication_policy
        self._retail_prices = (
            (retail_prices or AzureRetailPrices(timeout_s=polling.request_timeout_s)) if live_prices else None
        )
        self._polling = polling
        self._clients: dict[str, ComputeManagementClient] = {}
        self._quotes = QuoteBook(clock=self._clock, ttl_s=price_ttl_s)

    def _vms(self, pool: PoolSpec) -> Any:
        """The `virtual_machines` operations of the pool's subscription."""
        assert pool.azure is not None
        subscription = pool.azure.subscription_id
        if subscription not in self._clients:
            if self._credential is None:
                self._credential = DefaultAzureCredential()
            self._clients[subscription] = ComputeManagementClient(self._credential, subscription, **self._client_kwargs)
        return self._clients[subscription].virtual_machines

    @contextmanager
    def _translate(self, pool: PoolSpec, zone: str | None) -> Iterator[None]:
        """Azure errors -> `CredentialsError`, `PoolConfigError`, or (in a zone) `ZoneUnavailable`."""
        try:
            yield
        except ClientAuthenticationError as error:
            raise CredentialsError(
                pool.name, f"Azure rejected the credentials ({_first_line(error.message)}): {LOGIN_FIX}"
            ) from None
        except (ServiceRequestError, ServiceResponseError) as error:
            if zone is None:
                raise
            raise ZoneUnavailable(zone, "transient", _first_line(str(error))) from None
        except HttpResponseError as error:
            code = error.error.code if error.error else ""
            message = _first_line(error.error.message if error.error else str(error))
            detail = f"{code}: {message}"
            if code in CREDENTIAL_CODES or error.status_code == 401:
                raise CredentialsError(pool.name, f"Azure rejected the credentials ({detail}): {LOGIN_FIX}") from None
            if code == "AuthorizationFailed" or error.status_code == 403:
                raise CredentialsError(
                    pool.name,
                    f"permission denied ({detail}): give the identity the Virtual Machine Contributor role "
                    "on the resource group and Network Contributor on the subnet",
                ) from None
            if zone is not None:
                if code in CAPACITY_CODES:
                    raise ZoneUnavailable(zone, "capacity", detail) from None
                if code in QUOTA_CODES or (code == "OperationNotAllowed" and "quota" in message.lower()):
                    raise ZoneUnavailable(zone, "quota", detail) from None
                if code in TRANSIENT_CODES or error.status_code in (429, 500, 502, 503, 504):
                    raise ZoneUnavailable(zone, "transient", detail) from None
            if code in NOT_FOUND_FIXES:
                raise PoolConfigError(pool.name, f"{detail}: {NOT_FOUND_FIXES[code]}") from None
            if error.status_code in (400, 404, 409):
                raise PoolConfigError(pool.name, f"Azure refused the VM ({detail}): {_fix_for(message)}") from None
            raise

    # -- ZonalCloudProvider ---------------------------------------------------------------------

    def _create(
        self, pool: PoolSpec, zone: str, names: Sequence[str], labels: dict[str, str], plans: dict[str, BootPlan]
    ) -> tuple[list[str], ZoneUnavailable | None]:
        assert pool.azure is not None
        vms = self._vms(pool)
        pollers = []
        failure: ZoneUnavailable | None = None
        for name in names:
            try:
                with self._translate(pool, zone):
                    poller = vms.begin_create_or_update(
                        pool.azure.resource_group, name, self.virtual_machine(pool, zone, name, labels, plans[name])
                    )
            except ZoneUnavailable as error:
                failure = error
                break
            pollers.append((name, poller))
        created = []
        for name, poller in pollers:
            try:
                with self._translate(pool, zone):
                    poller.result(timeout=self._polling.timeout_s)
            except ZoneUnavailable as error:
                failure = failure or error
                self._delete(pool, zone, name)  # a VM whose allocation failed stays, in state Failed
                continue
            if poller.done():
                created.append(name)
            else:
                failure = failure or ZoneUnavailable(
                    zone, "transient", f"{name} still being created after {self._polling.timeout_s:.0f} s"
                )
        return created, failure

    def virtual_machine(
        self, pool: PoolSpec, zone: str, name: str, labels: dict[str, str], plan: BootPlan = BootPlan()
    ) -> m.VirtualMachine:
        """The VM one `create_or_update` asks for, booting with `plan`."""
        settings = pool.azure
        assert settings is not None
        location, number = split_zone(zone)
        script = render_startup_script(
            self._bootstrap, pool=pool, instance_id=name, run_id=self.run_id, watcher="azure", plan=plan
        )
        vm = m.VirtualMachine(
            location=location,
            zones=[number] if number else None,
            tags=labels,
            hardware_profile=m.HardwareProfile(vm_size=pool.machine_type),
            storage_profile=m.StorageProfile(
                image_reference=image_reference(settings.image),
                os_disk=m.OSDisk(create_option="FromImage", delete_option="Delete", disk_size_gb=settings.os_disk_gb),
            ),
            os_profile=m.OSProfile(
                computer_name=name,
                admin_username=settings.admin_username,
                custom_data=base64.b64encode(script.encode()).decode(),
                linux_configuration=m.LinuxConfiguration(
                    disable_password_authentication=True,
                    ssh=m.SshConfiguration(
                        public_keys=[
                            m.SshPublicKey(
                                path=f"/home/{settings.admin_username}/.ssh/authorized_keys",
                                key_data=settings.ssh_public_key,
                            )
                        ]
                    ),
                ),
            ),
            network_profile=m.NetworkProfile(
                network_api_version=NETWORK_API_VERSION,
                network_interface_configurations=[
                    m.VirtualMachineNetworkInterfaceConfiguration(
                        name=f"{name}-nic",
                        primary=True,
                        delete_option="Delete",
                        ip_configurations=[
                            m.VirtualMachineNetworkInterfaceIPConfiguration(
                                name=f"{name}-ip",
                                subnet=m.SubResource(id=settings.subnet_id),
                            )
                        ],
                    )
                ],
            ),
        )
        if settings.identity:
            vm.identity = m.VirtualMachineIdentity(
                type="UserAssigned", user_assigned_identities={settings.identity: m.UserAssignedIdentitiesValue()}
            )
        if pool.capacity_class == "spot":
            vm.priority = "Spot"
            vm.eviction_policy = "Delete"
            vm.billing_profile = m.BillingProfile(max_price=pool.max_price_per_hour or -1)
        return vm

    def _delete(self, pool: PoolSpec, zone: str, name: str) -> None:
        assert pool.azure is not None
        with self._translate(pool, None):
            try:
                self._vms(pool).begin_delete(pool.azure.resource_group, name)
            except ResourceNotFoundError:
                log.info("pool %s: %s is already gone", pool.name, name)

    def _observe(self, pool: PoolSpec) -> list[ObservedInstance]:
        assert pool.azure is not None
        wanted = {LABEL_RUN: label_value(self.run_id), LABEL_POOL: label_value(pool.name)}
        with self._translate(pool, None):
            listed = list(self._vms(pool).list(pool.azure.resource_group))
        seen = []
        for vm in listed:
            tags = vm.tags or {}
            if any(tags.get(key) != value for key, value in wanted.items()):
                continue
            zone = vm.location + (f"-{vm.zones[0]}" if vm.zones else "")
            step = tags.get(LABEL_STEP, "")
            seen.append(
                ObservedInstance(
                    vm.name,
                    pool.name,
                    zone,
                    STATES.get(vm.provisioning_state or "", "running"),
                    created_at=vm.time_created.timestamp() if vm.time_created else None,
                    launch_step=int(step) if step.isdigit() else None,
                )
            )
        return seen

    def labelled(self, pool: PoolSpec) -> list[LabelledVm]:
        assert pool.azure is not None
        with self._translate(pool, None):
            listed = list(self._vms(pool).list(pool.azure.resource_group))
        return [
            LabelledVm(
                self.provider_name,
                vm.name,
                vm.location + (f"-{vm.zones[0]}" if vm.zones else ""),
                vm.tags[LABEL_RUN],
                vm.tags.get(LABEL_POOL, ""),
                STATES.get(vm.provisioning_state or "", "running"),
                vm.time_created.timestamp() if vm.time_created else None,
                pool,
            )
            for vm in listed
            if LABEL_RUN in (vm.tags or {})
        ]

    def _notice_times(self, pool: PoolSpec, zone: str, names: Sequence[str], now: float) -> dict[str, float]:
        """Azure keeps no record of an eviction once the VM is deleted: a spot VM lost without our
        asking was evicted (its Scheduled Events notice came within the last refresh interval)."""
        return dict.fromkeys(names, now) if pool.capacity_class == "spot" else {}

    def _region(self, zone: str) -> str:
        return split_zone(zone)[0]

    def _quote_zone(self, pool: PoolSpec, zone: str) -> float:
        prices = self._retail_prices
        live = (
            None
            if prices is None
            else (lambda: prices.hourly_price(split_zone(zone)[0], pool.machine_type, pool.capacity_class == "spot"))
        )
        return self._quotes.quote(pool, zone, live)


def _first_line(text: str) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _fix_for(message: str) -> str:
    """What to change, from what Azure names in a refusal."""
    lowered = message.lower()
    if "size" in lowered:
        return "set machine_type to a VM size offered in every location of the pool (`az vm list-sizes -l LOCATION`)"
    if "image" in lowered:
        return "set azure.image to an image you can use (`az vm image list`)"
    if "subnet" in lowered:
        return "set azure.subnet_id to a subnet in the VMs' region"
    return "check the pool's azure settings against the message"
