"""A fake Azure Resource Manager for `Microsoft.Compute/virtualMachines`, as `azure-mgmt-compute`
sends it: create-or-update (201 + `Azure-AsyncOperation`), get, list (paged), delete (202), and
the async operation status documents the SDK's poller follows.

VM bodies are checked field by field (unknown fields are violations) and against Azure's rules
(a Spot VM needs an eviction policy, `maxPrice` is -1 or positive, custom data is base64, VM sizes
exist per location, the resource group exists). Scripted: `exhaust(location_zone)` (the create
operation fails with `ZonalAllocationFailed` and leaves the VM `Failed`), `exceed_quota(location)`
(409 `OperationNotAllowed`), `evict(name)` (the VM starts deleting, as Spot eviction with policy
Delete does), `settle()` (deleting VMs are gone). Auth: with `token=None` no Authorization header
is expected (the SDK runs with `SansIOHTTPPolicy`); otherwise `Bearer <token>` is required and any
other token gets 401 `ExpiredAuthenticationToken`.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tests.fakes.http import FakeServer, Reply, Request, Violation, check_keys

SIZES = {"eastus": {"Standard_NC4as_T4_v3", "Standard_D4s_v5"}, "westus2": {"Standard_NC4as_T4_v3"}}
API_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}(-preview)?$")
VM_FIELDS = {
    "location": None,
    "zones": None,
    "tags": {},
    "identity": {"type": None, "userAssignedIdentities": {}},
    "properties": {
        "hardwareProfile": {"vmSize": None},
        "storageProfile": {
            "imageReference": {"publisher": None, "offer": None, "sku": None, "version": None, "id": None},
            "osDisk": {"createOption": None, "deleteOption": None, "diskSizeGB": None},
        },
        "osProfile": {
            "computerName": None,
            "adminUsername": None,
            "customData": None,
            "linuxConfiguration": {
                "disablePasswordAuthentication": None,
                "ssh": {"publicKeys": [{"path": None, "keyData": None}]},
            },
        },
        "networkProfile": {
            "networkApiVersion": None,
            "networkInterfaceConfigurations": [
                {
                    "name": None,
                    "properties": {
                        "primary": None,
                        "deleteOption": None,
                        "ipConfigurations": [{"name": None, "properties": {"subnet": {"id": None}}}],
                    },
                }
            ],
        },
        "priority": None,
        "evictionPolicy": None,
        "billingProfile": {"maxPrice": None},
    },
}


def arm_error(status: int, code: str, message: str) -> Reply:
    return Reply(status, {"error": {"code": code, "message": message}})


@dataclass
class _Operation:
    polls_left: int
    finish: Callable[[], dict[str, Any] | None]
    """Runs once when the operation ends; returns its error (None: Succeeded)."""
    result: dict[str, Any] | None = None


@dataclass
class FakeArm(FakeServer):
    clock: Callable[[], float] = lambda: 0.0
    subscription: str = "00000000-0000-4000-8000-000000000001"
    resource_groups: set[str] = field(default_factory=lambda: {"rollout-rg"})
    operation_polls: int = 2
    token: str | None = None
    page_size: int = 2
    vms: dict[str, dict[str, Any]] = field(default_factory=dict)
    operations: dict[str, _Operation] = field(default_factory=dict)
    exhausted: set[str] = field(default_factory=set)
    """`<location>-<zone>` (or a bare location) without capacity."""
    quota_exceeded: set[str] = field(default_factory=set)
    api_versions: set[str] = field(default_factory=set)
    custom_data: dict[str, str] = field(default_factory=dict)
    """VM name -> its decoded custom data (the boot script), which Azure never returns in a GET."""

    def __post_init__(self) -> None:
        super().__init__()

    def routes(self):
        vms = r"/subscriptions/(?P<sub>[^/]+)/resourceGroups/(?P<rg>[^/]+)/providers/Microsoft\.Compute/virtualMachines"
        return [
            ("PUT", vms + r"/(?P<name>[^/]+)", self._put),
            ("GET", vms + r"/(?P<name>[^/]+)", self._get),
            ("DELETE", vms + r"/(?P<name>[^/]+)", self._delete),
            ("GET", vms, self._list),
            (
                "GET",
                r"/subscriptions/(?P<sub>[^/]+)/providers/Microsoft\.Compute/locations/(?P<location>[^/]+)/operations/(?P<op>[^/]+)",
                self._operation_status,
            ),
        ]

    # -- scripted cloud -------------------------------------------------------------------------

    def exhaust(self, zone: str) -> None:
        self.exhausted.add(zone)

    def exceed_quota(self, location: str) -> None:
        self.quota_exceeded.add(location)

    def evict(self, name: str) -> None:
        with self.lock:
            self.vms[name]["properties"]["provisioningState"] = "Deleting"

    def settle(self) -> None:
        with self.lock:
            for name in [n for n, vm in self.vms.items() if vm["properties"]["provisioningState"] == "Deleting"]:
                del self.vms[name]

    def names(self, state: str = "Succeeded") -> list[str]:
        with self.lock:
            return sorted(n for n, vm in self.vms.items() if vm["properties"]["provisioningState"] == state)

    # -- endpoints ------------------------------------------------------------------------------

    def _checked(self, request: Request, sub: str, rg: str | None = None) -> Reply | None:
        version = request.query.get("api-version", "")
        if not API_VERSION.match(version):
            raise Violation(f"api-version {version!r}")
        self.api_versions.add(version)
        given = request.headers.get("authorization")
        if self.token is None and given is not None:
            raise Violation("an Authorization header over plain http")
        if self.token is not None and given != f"Bearer {self.token}":
            return arm_error(
                401, "ExpiredAuthenticationToken", "The access token expiry UTC time is earlier than current UTC time."
            )
        if sub != self.subscription:
            return arm_error(404, "SubscriptionNotFound", f"The subscription '{sub}' could not be found.")
        if rg is not None and rg not in self.resource_groups:
            return arm_error(404, "ResourceGroupNotFound", f"Resource group '{rg}' could not be found.")
        return None

    def _vm_id(self, rg: str, name: str) -> str:
        return (
            f"/subscriptions/{self.subscription}/resourceGroups/{rg}/providers/Microsoft.Compute/virtualMachines/{name}"
        )

    def _async(self, location: str, finish: Callable[[], dict[str, Any] | None], version: str) -> dict[str, str]:
        op = uuid.uuid4().hex
        self.operations[op] = _Operation(self.operation_polls, finish)
        url = f"{self.url}/subscriptions/{self.subscription}/providers/Microsoft.Compute/locations/{location}/operations/{op}?api-version={version}"
        return {"Azure-AsyncOperation": url}

    def _put(self, request: Request, sub: str, rg: str, name: str) -> Reply:
        with self.lock:
            refused = self._checked(request, sub, rg)
            if refused:
                return refused
            body = request.body
            check_keys("virtualMachine", body, VM_FIELDS)
            refused = self._check_vm(name, body)
            if refused:
                return refused
            location = body["location"]
            zones = body.get("zones") or []
            where = f"{location}-{zones[0]}" if zones else location
            if location in self.quota_exceeded:
                return arm_error(
                    409,
                    "OperationNotAllowed",
                    "Operation could not be completed as it results in exceeding "
                    f"approved LowPriorityCores quota. Location: {location}, Current Limit: 0.",
                )
            props = body["properties"]
            vm = {
                "id": self._vm_id(rg, name),
                "name": name,
                "type": "Microsoft.Compute/virtualMachines",
                "location": location,
                "tags": body.get("tags", {}),
                **({"zones": zones} if zones else {}),
                "properties": {
                    **props,
                    "provisioningState": "Creating",
                    "vmId": str(uuid.uuid4()),
                    "timeCreated": datetime.fromtimestamp(self.clock(), UTC).isoformat(),
                },
            }
            vm["properties"]["osProfile"] = {k: v for k, v in props["osProfile"].items() if k != "customData"}
            self.custom_data[name] = base64.b64decode(props["osProfile"].get("customData", "")).decode()
            self.vms[name] = vm
            exhausted = where in self.exhausted

            def finish() -> dict[str, Any] | None:
                if exhausted:
                    vm["properties"]["provisioningState"] = "Failed"
                    code = "ZonalAllocationFailed" if zones else "AllocationFailed"
                    return {
                        "code": code,
                        "message": "Allocation failed. We do not have sufficient capacity for the "
                        "requested VM size in this zone. Read more about improving likelihood of allocation success at http://aka.ms/allocation-guidance",
                    }
                vm["properties"]["provisioningState"] = "Succeeded"
                return None

            return Reply(201, vm, self._async(location, finish, request.query["api-version"]))

    def _check_vm(self, name: str, body: dict[str, Any]) -> Reply | None:
        props = body.get("properties", {})
        for path in ("hardwareProfile", "storageProfile", "osProfile", "networkProfile"):
            if path not in props:
                raise Violation(f"properties.{path} missing")
        location = body.get("location")
        if location not in SIZES:
            return arm_error(
                400,
                "LocationNotAvailableForResourceType",
                f"The provided location '{location}' is not available for resource type 'Microsoft.Compute/virtualMachines'.",
            )
        size = props["hardwareProfile"].get("vmSize")
        if size not in SIZES[location]:
            return arm_error(
                400,
                "InvalidParameter",
                f"The requested VM size {size} is not available in the current "
                f"region. The sizes available in the current region are: {', '.join(sorted(SIZES[location]))}.",
            )
        identity = body.get("identity")
        if identity is not None:
            ids = identity.get("userAssignedIdentities") or {}
            if identity.get("type") != "UserAssigned" or not ids or any(v != {} for v in ids.values()):
                raise Violation(f"identity {identity!r}: expected type UserAssigned with {{id: {{}}}} entries")
            bad = [i for i in ids if "/providers/Microsoft.ManagedIdentity/userAssignedIdentities/" not in i]
            if bad:
                return arm_error(400, "InvalidIdentityValues", f"Invalid value for the identities {bad}.")
        priority = props.get("priority", "Regular")
        if priority not in ("Regular", "Spot", "Low"):
            raise Violation(f"priority {priority!r}")
        if priority == "Spot" and props.get("evictionPolicy") not in ("Deallocate", "Delete"):
            return arm_error(400, "InvalidParameter", "Eviction policy must be specified for Spot virtual machines.")
        max_price = props.get("billingProfile", {}).get("maxPrice")
        if max_price is not None and not (max_price == -1 or max_price > 0):
            return arm_error(400, "InvalidParameter", "The value of parameter billingProfile.maxPrice is invalid.")
        os_profile = props["osProfile"]
        if os_profile.get("computerName") != name:
            raise Violation("osProfile.computerName differs from the VM name")
        try:
            base64.b64decode(os_profile.get("customData", ""), validate=True)
        except binascii.Error:
            return arm_error(400, "InvalidParameter", "Custom data in OSProfile must be in Base64 encoding.")
        keys = os_profile.get("linuxConfiguration", {}).get("ssh", {}).get("publicKeys", [])
        if not keys:
            return arm_error(
                400,
                "InvalidParameter",
                "Authentication using either SSH or by user name and password must be enabled in Linux profile.",
            )
        nics = props["networkProfile"].get("networkInterfaceConfigurations", [])
        if not nics or props["networkProfile"].get("networkApiVersion") is None:
            raise Violation("networkProfile: interface configurations need networkApiVersion")
        return None

    def _get(self, request: Request, sub: str, rg: str, name: str) -> Reply:
        with self.lock:
            refused = self._checked(request, sub, rg)
            if refused:
                return refused
            if name not in self.vms:
                return arm_error(
                    404,
                    "ResourceNotFound",
                    f"The Resource 'Microsoft.Compute/virtualMachines/{name}' under resource group '{rg}' was not found.",
                )
            return Reply(200, self.vms[name])

    def _list(self, request: Request, sub: str, rg: str) -> Reply:
        with self.lock:
            refused = self._checked(request, sub, rg)
            if refused:
                return refused
            start = int(request.query.get("$skiptoken", "0"))
            listed = [self.vms[n] for n in sorted(self.vms)]
            page = {"value": listed[start : start + self.page_size]}
            if start + self.page_size < len(listed):
                page["nextLink"] = (
                    f"{self.url}{request.path}?api-version={request.query['api-version']}"
                    f"&$skiptoken={start + self.page_size}"
                )
            return Reply(200, page)

    def _delete(self, request: Request, sub: str, rg: str, name: str) -> Reply:
        with self.lock:
            refused = self._checked(request, sub, rg)
            if refused:
                return refused
            vm = self.vms.get(name)
            if vm is None:
                return Reply(204)
            vm["properties"]["provisioningState"] = "Deleting"
            return Reply(202, None, self._async(vm["location"], lambda: None, request.query["api-version"]))

    def _operation_status(self, request: Request, sub: str, location: str, op: str) -> Reply:
        with self.lock:
            refused = self._checked(request, sub)
            if refused:
                return refused
            operation = self.operations.get(op)
            if operation is None:
                return arm_error(404, "NotFound", f"operation {op} not found")
            if operation.result is None:
                operation.polls_left -= 1
                if operation.polls_left > 0:
                    return Reply(200, {"name": op, "status": "InProgress"})
                error = operation.finish()
                operation.result = {
                    "name": op,
                    "status": "Failed" if error else "Succeeded",
                    **({"error": error} if error else {}),
                }
            return Reply(200, operation.result)
