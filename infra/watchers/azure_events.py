"""Azure's eviction notice, from Scheduled Events in the Instance Metadata Service.

`GET /metadata/scheduledevents?api-version=2020-07-01` (header `Metadata: true`) returns
`{"DocumentIncarnation": n, "Events": [...]}`; a Spot eviction is an event of `EventType`
`Preempt` whose `Resources` name this VM, at least 30 s before `NotBefore`. The watcher polls every
`poll_s`. Once the VM has drained, `acknowledge` POSTs `{"StartRequests": [{"EventId": ...}]}`
to the same URL so the eviction need not wait for its deadline.
"""

from __future__ import annotations

import logging
import os
import threading

import httpx

from infra.watchers.supervisor import PreemptionNotice
from rl import env_vars

log = logging.getLogger(__name__)

AZURE_IMDS_URL = "http://169.254.169.254"
SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents"
API_VERSION = "2020-07-01"
HEADERS = {"Metadata": "true"}
IMDS_URL_ENV = env_vars.AZURE_IMDS_URL


def default_imds_url() -> str:
    """`$RLBOOST_AZURE_IMDS_URL` when that is set, else IMDS's link-local address."""
    return os.environ.get(IMDS_URL_ENV) or AZURE_IMDS_URL


class AzureScheduledEventsWatcher:
    """Waits for a `Preempt` scheduled event of this VM."""

    def __init__(
        self,
        base_url: str = AZURE_IMDS_URL,
        *,
        instance: str | None = None,
        poll_s: float = 1.0,
        timeout_s: float = 10.0,
    ) -> None:
        """`instance`: this VM's name (None: any `Preempt` event counts, as on a single-VM document)."""
        self.url = base_url.rstrip("/") + SCHEDULED_EVENTS_PATH
        self._instance = instance
        self._poll_s = poll_s
        self._timeout_s = timeout_s

    def wait_for_notice(self, stop: threading.Event) -> PreemptionNotice | None:
        with httpx.Client(headers=HEADERS, timeout=self._timeout_s) as http:
            while not stop.is_set():
                try:
                    response = http.get(self.url, params={"api-version": API_VERSION})
                    response.raise_for_status()
                    events = response.json().get("Events", [])
                except (httpx.HTTPError, ValueError) as error:
                    log.warning("scheduled events: %s; retrying in %.0f s", error, self._poll_s)
                    events = []
                for event in events:
                    if event.get("EventType") == "Preempt" and (
                        self._instance is None or self._instance in event.get("Resources", [])
                    ):
                        return PreemptionNotice("azure-scheduled-events", event["EventId"], event.get("NotBefore"))
                stop.wait(self._poll_s)
        return None

    def acknowledge(self, notice: PreemptionNotice) -> None:
        """Approve the eviction now (a failure only means Azure waits for `NotBefore`)."""
        body = {"StartRequests": [{"EventId": notice.event_id}]}
        try:
            response = httpx.post(
                self.url, params={"api-version": API_VERSION}, json=body, headers=HEADERS, timeout=self._timeout_s
            )
            response.raise_for_status()
        except httpx.HTTPError as error:
            log.warning("could not acknowledge scheduled event %s: %s", notice.event_id, error)
