"""Fake in-VM metadata services: the GCE metadata server's `instance/preempted` (with
`wait_for_change` long polls) and Azure IMDS Scheduled Events (with `StartRequests` approvals).

Both check the headers and query strings the real services require (a missing `Metadata-Flavor:
Google` or `Metadata: true` header is a violation) and answer in the real formats.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any

from tests.fakes.http import FakeServer, Reply, Request, Violation

SCHEDULED_EVENTS_API = "2020-07-01"


@dataclass
class FakeGceMetadata(FakeServer):
    """`GET /computeMetadata/v1/instance/preempted`: `FALSE` until `preempt()`, then `TRUE`."""

    max_wait_s: float = 5.0
    """Cap on a long poll's `timeout_sec` (keeps tests fast)."""
    preempted: bool = False
    changed: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        super().__init__()

    def routes(self):
        return [("GET", r"/computeMetadata/v1/instance/preempted", self._preempted)]

    def preempt(self) -> None:
        with self.changed:
            self.preempted = True
            self.changed.notify_all()

    def _etag(self) -> str:
        return "a1b2c3d4e5f6" if self.preempted else "0f9e8d7c6b5a"

    def _preempted(self, request: Request) -> Reply:
        if request.headers.get("metadata-flavor") != "Google":
            raise Violation("missing Metadata-Flavor: Google")
        unknown = set(request.query) - {"wait_for_change", "last_etag", "timeout_sec"}
        if unknown:
            raise Violation(f"unknown query parameters {sorted(unknown)}")
        if request.query.get("wait_for_change") == "true":
            timeout = min(float(request.query.get("timeout_sec", self.max_wait_s)), self.max_wait_s)
            with self.changed:
                self.changed.wait_for(lambda: self._etag() != request.query.get("last_etag"), timeout)
        with self.changed:
            value, etag = ("TRUE" if self.preempted else "FALSE"), self._etag()
        return Reply(200, value, {"ETag": etag, "Metadata-Flavor": "Google"})


@dataclass
class FakeScheduledEvents(FakeServer):
    """`GET/POST /metadata/scheduledevents?api-version=2020-07-01` of Azure IMDS."""

    events: list[dict[str, Any]] = field(default_factory=list)
    incarnation: int = 1
    approvals: list[tuple[str, float]] = field(default_factory=list)
    """(EventId, wall time) of every StartRequest."""

    def __post_init__(self) -> None:
        super().__init__()

    def routes(self):
        return [
            ("GET", r"/metadata/scheduledevents", self._document),
            ("POST", r"/metadata/scheduledevents", self._start),
        ]

    def schedule(self, event_type: str, resources: list[str], notice_s: float = 30.0) -> str:
        event_id = str(uuid.uuid4()).upper()
        with self.lock:
            self.events.append(
                {
                    "EventId": event_id,
                    "EventStatus": "Scheduled",
                    "EventType": event_type,
                    "ResourceType": "VirtualMachine",
                    "Resources": resources,
                    "NotBefore": formatdate(time.time() + notice_s, usegmt=True),
                    "Description": "",
                    "EventSource": "Platform",
                    "DurationInSeconds": -1,
                }
            )
            self.incarnation += 1
        return event_id

    def _check(self, request: Request) -> None:
        if request.headers.get("metadata") != "true":
            raise Violation("Bad request. Required metadata header not specified")
        if request.query.get("api-version") != SCHEDULED_EVENTS_API:
            raise Violation("Bad request. api-version is invalid or was not specified in the request.")

    def _document(self, request: Request) -> Reply:
        self._check(request)
        with self.lock:
            return Reply(200, {"DocumentIncarnation": self.incarnation, "Events": list(self.events)})

    def _start(self, request: Request) -> Reply:
        self._check(request)
        body = request.body
        if not isinstance(body, dict) or set(body) != {"StartRequests"} or not body["StartRequests"]:
            raise Violation(f"body {body!r}: expected {{'StartRequests': [{{'EventId': ...}}]}}")
        with self.lock:
            known = {e["EventId"] for e in self.events}
            for start in body["StartRequests"]:
                if set(start) != {"EventId"} or start["EventId"] not in known:
                    raise Violation(f"StartRequest {start!r}: not a scheduled event")
                self.approvals.append((start["EventId"], time.time()))
            self.events = [e for e in self.events if e["EventId"] not in {s["EventId"] for s in body["StartRequests"]}]
            self.incarnation += 1
        return Reply(200, None)
