"""A fake Compute Engine (REST, `compute/v1`) and Google OAuth token endpoint.

Implements what `infra.providers.gcp` uses, as `google-cloud-compute` sends it: instances
insert/list/get/delete, zone operations get/wait/list, machineTypes get, and `/token` (refresh-token
grants of `google.oauth2.credentials.Credentials`). Instance bodies are checked field by field
(unknown fields are violations) and against the rules GCE enforces (Spot VMs cannot restart
automatically or live-migrate, GPUs need `onHostMaintenance: TERMINATE`, label syntax, known
machine and accelerator types per zone).

Scripted cloud behaviour: `exhaust(zone)` (inserts end in `ZONE_RESOURCE_POOL_EXHAUSTED`),
`exceed_quota(region)` (`QUOTA_EXCEEDED`), `refusals[zone]` (an immediate HTTP error such as 429
`rateLimitExceeded` or 403 `quotaExceeded`), `preempt(name)` (STOPPING plus a
`compute.instances.preempted` operation), `vanish(name)` (gone without a trace), `settle()` (every
STOPPING instance finishes: deleted). Operations finish after `operation_polls` polls. Auth:
`token=None` accepts anonymous requests; otherwise `Authorization: Bearer <token>` is required and
`refresh_tokens` and `service_accounts` (JWTs signed with a key file's private key) are the grants
`/token` honours; a service account's self-signed JWT is accepted as a bearer token too.
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl

from tests.fakes.http import FakeServer, Reply, Request, Violation, check_keys

ZONES = {
    "us-central1-a": {"g2-standard-8": (8, 32768, [("nvidia-l4", 1)]), "n1-standard-4": (4, 15360, [])},
    "us-central1-b": {"g2-standard-8": (8, 32768, [("nvidia-l4", 1)]), "n1-standard-4": (4, 15360, [])},
    "us-east1-c": {"n1-standard-4": (4, 15360, [])},
}
"""zone -> machine type -> (vCPUs, memory MB, built-in accelerators)."""
ACCELERATORS = {
    "us-central1-a": {"nvidia-l4", "nvidia-tesla-t4"},
    "us-central1-b": {"nvidia-l4", "nvidia-tesla-t4"},
    "us-east1-c": {"nvidia-tesla-t4"},
}
API = "https://www.googleapis.com/compute/v1"
NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
LIST_FILTER = re.compile(r'^(\(labels\.([a-z0-9_-]+) = "([a-z0-9_-]*)"\) ?)+$')
HAS_LABEL_FILTER = re.compile(r"^labels\.([a-z0-9_-]+):\*$")
"""`labels.KEY:*`: the instances that carry label KEY, whatever its value (the API's presence test)."""
FILTER_TERM = re.compile(r'\(labels\.([a-z0-9_-]+) = "([a-z0-9_-]*)"\)')
OPERATIONS_FILTER = re.compile(r'^operationType = "([a-z.]+)"$')
INSTANCE_FIELDS = {
    "name": None,
    "machineType": None,
    "labels": {},
    "scheduling": {
        "provisioningModel": None,
        "instanceTerminationAction": None,
        "automaticRestart": None,
        "onHostMaintenance": None,
    },
    "disks": [
        {
            "boot": None,
            "autoDelete": None,
            "initializeParams": {"sourceImage": None, "diskSizeGb": None, "diskType": None},
        }
    ],
    "networkInterfaces": [{"network": None, "subnetwork": None, "accessConfigs": [{"name": None, "type": None}]}],
    "serviceAccounts": [{"email": None, "scopes": None}],
    "metadata": {"items": [{"key": None, "value": None}]},
    "guestAccelerators": [{"acceleratorType": None, "acceleratorCount": None}],
}


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


def gce_error(status: int, reason: str, message: str) -> Reply:
    return Reply(
        status,
        {
            "error": {
                "code": status,
                "message": message,
                "errors": [{"message": message, "domain": "global", "reason": reason}],
            }
        },
    )


@dataclass
class _Operation:
    body: dict[str, Any]
    polls_left: int
    on_done: Callable[[], dict[str, Any] | None] = lambda: None
    """Runs when the operation finishes; returns its error (or None)."""


@dataclass
class FakeGce(FakeServer):
    clock: Callable[[], float] = lambda: 0.0
    project: str = "rollout-proj"
    operation_polls: int = 2
    """Polls (get/wait) before an operation is DONE."""
    token: str | None = None
    refresh_tokens: set[str] = field(default_factory=set)
    service_accounts: dict[str, str] = field(default_factory=dict)
    """Service-account e-mail -> the PEM public key of its key file (JWT-bearer grants)."""
    instances: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    """(zone, name) -> instance resource."""
    operations: dict[tuple[str, str], _Operation] = field(default_factory=dict)
    exhausted: set[str] = field(default_factory=set)
    quota_exceeded: set[str] = field(default_factory=set)
    refusals: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    """zone -> (HTTP status, reason, message) every insert there gets at once (throttling, quota)."""

    def __post_init__(self) -> None:
        super().__init__()
        self._ids = itertools.count(1000)

    def routes(self):
        base = r"/compute/v1/projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)"
        return [
            ("POST", base + r"/instances", self._insert),
            ("GET", base + r"/instances", self._list),
            ("GET", base + r"/instances/(?P<name>[^/]+)", self._get),
            ("DELETE", base + r"/instances/(?P<name>[^/]+)", self._delete),
            ("POST", base + r"/operations/(?P<op>[^/]+)/wait", self._poll),
            ("GET", base + r"/operations/(?P<op>[^/]+)", self._poll),
            ("GET", base + r"/operations", self._list_operations),
            ("GET", base + r"/machineTypes/(?P<machine>[^/]+)", self._machine_type),
            ("POST", r"/token", self._token),
        ]

    # -- scripted cloud -------------------------------------------------------------------------

    def exhaust(self, zone: str) -> None:
        self.exhausted.add(zone)

    def restore(self, zone: str) -> None:
        self.exhausted.discard(zone)

    def exceed_quota(self, region: str) -> None:
        self.quota_exceeded.add(region)

    def zone_of(self, name: str) -> str:
        return next(zone for zone, listed in self.instances if listed == name)

    def preempt(self, name: str) -> None:
        """Spot preemption: the VM stops (30 s notice) and a preempted operation is logged."""
        with self.lock:
            zone = self.zone_of(name)
            instance = self.instances[zone, name]
            instance["status"] = "STOPPING"
            self._operation(zone, "compute.instances.preempted", instance["selfLink"], polls=0, user="system")

    def vanish(self, name: str) -> None:
        with self.lock:
            del self.instances[self.zone_of(name), name]

    def settle(self) -> None:
        """Every STOPPING instance finishes stopping and (termination action DELETE) is deleted."""
        with self.lock:
            for key in [k for k, v in self.instances.items() if v["status"] == "STOPPING"]:
                del self.instances[key]

    def names(self, zone: str | None = None, status: str = "RUNNING") -> list[str]:
        with self.lock:
            return sorted(n for (z, n), v in self.instances.items() if (zone in (None, z)) and v["status"] == status)

    # -- endpoints ------------------------------------------------------------------------------

    def _authorized(self, request: Request, project: str, zone: str) -> Reply | None:
        """A 401/404 answer when the request may not proceed, else None."""
        given = request.headers.get("authorization")
        if self.token is not None and given != f"Bearer {self.token}" and not self._self_signed(given or ""):
            message = (
                "Request had invalid authentication credentials. Expected OAuth 2 access token, login "
                "cookie or other valid authentication credential."
            )
            return Reply(
                401,
                {
                    "error": {
                        "code": 401,
                        "message": message,
                        "status": "UNAUTHENTICATED",
                        "errors": [{"message": "Invalid Credentials", "domain": "global", "reason": "authError"}],
                    }
                },
            )
        if project != self.project:
            return gce_error(404, "notFound", f"The resource 'projects/{project}' was not found")
        if zone not in ZONES:
            return gce_error(404, "notFound", f"The resource 'projects/{project}/zones/{zone}' was not found")
        return None

    def _operation(
        self,
        zone: str,
        kind: str,
        target: str,
        *,
        polls: int,
        on_done: Callable[[], dict[str, Any] | None] = lambda: None,
        user: str = "rollout@",
    ) -> dict[str, Any]:
        name = f"operation-{uuid.uuid4().hex[:12]}"
        body = {
            "kind": "compute#operation",
            "id": str(next(self._ids)),
            "name": name,
            "operationType": kind,
            "zone": f"{API}/projects/{self.project}/zones/{zone}",
            "targetLink": target,
            "user": user,
            "status": "RUNNING",
            "progress": 0,
            "insertTime": rfc3339(self.clock()),
            "selfLink": f"{API}/projects/{self.project}/zones/{zone}/operations/{name}",
        }
        operation = _Operation(body, polls, on_done)
        self.operations[zone, name] = operation
        if polls == 0:
            self._finish(operation)
        return body

    def _finish(self, operation: _Operation) -> None:
        error = operation.on_done()
        operation.body.update(status="DONE", progress=100, endTime=rfc3339(self.clock()))
        if error is not None:
            operation.body["error"] = {"errors": [error]}
            operation.body["httpErrorStatusCode"] = 503 if error["code"].startswith("ZONE_") else 403

    def _insert(self, request: Request, project: str, zone: str) -> Reply:
        with self.lock:
            denied = self._authorized(request, project, zone)
            if denied:
                return denied
            if set(request.query) - {"requestId"} or not UUID.match(request.query.get("requestId", "")):
                raise Violation(f"query {request.query}: expected only a UUID requestId")
            if zone in self.refusals:
                return gce_error(*self.refusals[zone])
            body = request.body
            check_keys("instance", body, INSTANCE_FIELDS)
            refused = self._check_instance(zone, body)
            if refused:
                return refused
            name = body["name"]
            if (zone, name) in self.instances:
                return gce_error(
                    409,
                    "alreadyExists",
                    f"The resource 'projects/{project}/zones/{zone}/instances/{name}' already exists",
                )
            link = f"{API}/projects/{project}/zones/{zone}/instances/{name}"
            instance = {
                **body,
                "kind": "compute#instance",
                "id": str(next(self._ids)),
                "status": "PROVISIONING",
                "zone": f"{API}/projects/{project}/zones/{zone}",
                "selfLink": link,
                "machineType": f"{API}/projects/{project}/{body['machineType']}",
                "creationTimestamp": rfc3339(self.clock()),
            }
            self.instances[zone, name] = instance
            capacity_error = self._capacity_error(zone, body)

            def come_up() -> dict[str, Any] | None:
                if capacity_error is None:
                    instance["status"] = "RUNNING"
                else:
                    self.instances.pop((zone, name), None)
                return capacity_error

            return Reply(200, self._operation(zone, "insert", link, polls=self.operation_polls, on_done=come_up))

    def _check_instance(self, zone: str, body: dict[str, Any]) -> Reply | None:
        """Violations raise; what GCE itself refuses comes back as its 400."""
        for key in ("name", "machineType", "disks", "networkInterfaces", "scheduling", "metadata"):
            if key not in body:
                raise Violation(f"instance: missing {key}")
        if not NAME.match(body["name"]):
            return gce_error(
                400,
                "invalid",
                f"Invalid value for field 'resource.name': '{body['name']}'. Must be a match of regex '(?:[a-z](?:[-a-z0-9]{{0,61}}[a-z0-9])?)'",
            )
        match = re.match(r"^zones/([^/]+)/machineTypes/([^/]+)$", body["machineType"])
        if not match or match.group(1) != zone:
            raise Violation(f"machineType {body['machineType']!r} is not zones/{zone}/machineTypes/<type>")
        if match.group(2) not in ZONES[zone]:
            return gce_error(
                400,
                "invalid",
                f"Invalid value for field 'resource.machineType': '{body['machineType']}'. "
                f"Machine type with name '{match.group(2)}' does not exist in zone '{zone}'.",
            )
        scheduling = body["scheduling"]
        spot = scheduling.get("provisioningModel") == "SPOT"
        if scheduling.get("provisioningModel") not in ("SPOT", "STANDARD"):
            raise Violation(f"scheduling.provisioningModel {scheduling.get('provisioningModel')!r}")
        if spot and scheduling.get("instanceTerminationAction") not in ("DELETE", "STOP"):
            raise Violation("a Spot VM must say its instanceTerminationAction")
        if spot and scheduling.get("automaticRestart", True):
            return gce_error(
                400,
                "invalid",
                "Invalid value for field 'resource.scheduling.automaticRestart': 'true'. Preemptible instances cannot be automatically restarted.",
            )
        accelerators = body.get("guestAccelerators", [])
        if (spot or accelerators) and scheduling.get("onHostMaintenance") != "TERMINATE":
            return gce_error(
                400,
                "invalid",
                "Invalid value for field 'resource.scheduling.onHostMaintenance': 'MIGRATE'. Instances with guest accelerators or Spot VMs do not support live migration.",
            )
        for accelerator in accelerators:
            match = re.match(r"^zones/([^/]+)/acceleratorTypes/([^/]+)$", accelerator.get("acceleratorType", ""))
            if not match or match.group(1) != zone or not isinstance(accelerator.get("acceleratorCount"), int):
                raise Violation(f"guestAccelerators: {accelerator}")
            if match.group(2) not in ACCELERATORS[zone]:
                return gce_error(
                    400,
                    "invalid",
                    f"Invalid value for field 'resource.guestAccelerators[0].acceleratorType': "
                    f"'{accelerator['acceleratorType']}'. Accelerator type '{match.group(2)}' does not exist in zone '{zone}'.",
                )
        for key, value in body.get("labels", {}).items():
            if not LABEL_KEY.match(key) or not LABEL_VALUE.match(value):
                return gce_error(
                    400, "invalid", f"Invalid value for field 'resource.labels': label {key}={value!r} is not valid."
                )
        boots = [d for d in body["disks"] if d.get("boot")]
        if len(boots) != 1 or not boots[0].get("initializeParams", {}).get("sourceImage"):
            raise Violation("disks: need exactly one boot disk with initializeParams.sourceImage")
        size = boots[0]["initializeParams"].get("diskSizeGb", "10")
        if not str(size).isdigit():
            raise Violation(f"diskSizeGb {size!r}")
        if not any(item.get("key") == "startup-script" for item in body["metadata"].get("items", [])):
            raise Violation("metadata: no startup-script")
        return None

    def _capacity_error(self, zone: str, body: dict[str, Any]) -> dict[str, Any] | None:
        region = zone.rsplit("-", 1)[0]
        if region in self.quota_exceeded:
            return {
                "code": "QUOTA_EXCEEDED",
                "message": f"Quota 'PREEMPTIBLE_NVIDIA_L4_GPUS' exceeded.  Limit: 0.0 in region {region}.",
            }
        if zone in self.exhausted:
            return {
                "code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                "message": f"The zone 'projects/{self.project}/zones/{zone}' does not have enough resources available to fulfill the request.  Try a different zone, or try again later.",
            }
        return None

    def _list(self, request: Request, project: str, zone: str) -> Reply:
        with self.lock:
            denied = self._authorized(request, project, zone)
            if denied:
                return denied
            wanted = request.query.get("filter", "")
            has = HAS_LABEL_FILTER.match(wanted)
            if set(request.query) - {"filter"} or (wanted and not (LIST_FILTER.match(wanted) or has)):
                raise Violation(f"list query {request.query}")
            terms = dict(FILTER_TERM.findall(wanted))
            items = [
                dict(v)
                for (z, _), v in sorted(self.instances.items())
                if z == zone
                and all(v.get("labels", {}).get(k) == val for k, val in terms.items())
                and (has is None or has.group(1) in v.get("labels", {}))
            ]
            return Reply(
                200,
                {
                    "kind": "compute#instanceList",
                    "id": f"projects/{project}/zones/{zone}/instances",
                    "items": items,
                    "selfLink": f"{API}/projects/{project}/zones/{zone}/instances",
                },
            )

    def _get(self, request: Request, project: str, zone: str, name: str) -> Reply:
        with self.lock:
            denied = self._authorized(request, project, zone)
            if denied:
                return denied
            if (zone, name) not in self.instances:
                return gce_error(
                    404, "notFound", f"The resource 'projects/{project}/zones/{zone}/instances/{name}' was not found"
                )
            return Reply(200, self.instances[zone, name])

    def _delete(self, request: Request, project: str, zone: str, name: str) -> Reply:
        with self.lock:
            denied = self._authorized(request, project, zone)
            if denied:
                return denied
            if set(request.query) - {"requestId"} or not UUID.match(request.query.get("requestId", "")):
                raise Violation(f"query {request.query}: expected only a UUID requestId")
            instance = self.instances.get((zone, name))
            if instance is None:
                return gce_error(
                    404, "notFound", f"The resource 'projects/{project}/zones/{zone}/instances/{name}' was not found"
                )
            instance["status"] = "STOPPING"
            return Reply(200, self._operation(zone, "delete", instance["selfLink"], polls=self.operation_polls))

    def _poll(self, request: Request, project: str, zone: str, op: str) -> Reply:
        with self.lock:
            denied = self._authorized(request, project, zone)
            if denied:
                return denied
            operation = self.operations.get((zone, op))
            if operation is None:
                return gce_error(
                    404, "notFound", f"The resource 'projects/{project}/zones/{zone}/operations/{op}' was not found"
                )
            if operation.body["status"] != "DONE":
                operation.polls_left -= 1
                if operation.polls_left <= 0:
                    self._finish(operation)
            return Reply(200, operation.body)

    def _list_operations(self, request: Request, project: str, zone: str) -> Reply:
        with self.lock:
            denied = self._authorized(request, project, zone)
            if denied:
                return denied
            match = OPERATIONS_FILTER.match(request.query.get("filter", ""))
            if set(request.query) != {"filter"} or not match:
                raise Violation(f"operations query {request.query}")
            items = [
                o.body
                for (z, _), o in self.operations.items()
                if z == zone and o.body["operationType"] == match.group(1)
            ]
            return Reply(200, {"kind": "compute#operationList", "items": items})

    def _machine_type(self, request: Request, project: str, zone: str, machine: str) -> Reply:
        with self.lock:
            denied = self._authorized(request, project, zone)
            if denied:
                return denied
            if machine not in ZONES[zone]:
                return gce_error(
                    404,
                    "notFound",
                    f"The resource 'projects/{project}/zones/{zone}/machineTypes/{machine}' was not found",
                )
            cpus, memory, accelerators = ZONES[zone][machine]
            return Reply(
                200,
                {
                    "kind": "compute#machineType",
                    "name": machine,
                    "guestCpus": cpus,
                    "memoryMb": memory,
                    "zone": zone,
                    "accelerators": [{"guestAcceleratorType": t, "guestAcceleratorCount": n} for t, n in accelerators],
                },
            )

    def _token(self, request: Request) -> Reply:
        form = dict(parse_qsl(request.body or ""))
        if form.get("grant_type") == JWT_BEARER:
            return self._service_account_token(form.get("assertion", ""))
        if form.get("grant_type") != "refresh_token" or not form.get("refresh_token"):
            raise Violation(f"token request {sorted(form)}")
        if form["refresh_token"] not in self.refresh_tokens:
            return Reply(400, {"error": "invalid_grant", "error_description": "Token has been expired or revoked."})
        return Reply(
            200,
            {
                "access_token": self.token,
                "expires_in": 3599,
                "token_type": "Bearer",
                "scope": "https://www.googleapis.com/auth/cloud-platform",
            },
        )

    def _self_signed(self, authorization: str) -> bool:
        """A service account's self-signed JWT (what the client libraries send instead of asking
        `/token`): signed by a known account's key, for Compute Engine or with a scope."""
        from google.auth import jwt

        token = authorization.removeprefix("Bearer ")
        try:
            claims = jwt.decode(token, verify=False)
            key = self.service_accounts.get(claims.get("iss", ""))
            if key is None:
                return False
            jwt.decode(token, certs=key)
        except ValueError:
            return False
        return claims.get("aud") == "https://compute.googleapis.com/" or "scope" in claims

    def _service_account_token(self, assertion: str) -> Reply:
        """A service-account key's signed JWT (RS256, issued by the account, for this endpoint)."""
        from google.auth import jwt

        try:
            claims = jwt.decode(assertion, verify=False)
        except ValueError as error:
            raise Violation(f"malformed JWT assertion: {error}") from None
        key = self.service_accounts.get(claims.get("iss", ""))
        if key is None:
            return Reply(400, {"error": "invalid_grant", "error_description": "Invalid JWT Signature."})
        try:
            jwt.decode(assertion, certs=key, audience=f"{self.url}/token")
        except ValueError as error:
            return Reply(400, {"error": "invalid_grant", "error_description": f"Invalid JWT: {error}"})
        if "scope" not in claims:
            raise Violation("the JWT assertion asks for no scope")
        return Reply(200, {"access_token": self.token, "expires_in": 3599, "token_type": "Bearer"})
