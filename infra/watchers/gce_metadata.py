"""Google Compute Engine's preemption notice, from the VM's metadata server.

The metadata server answers `GET /computeMetadata/v1/instance/preempted` (header
`Metadata-Flavor: Google`) with `TRUE` once the Spot VM is being preempted (30 s before it stops),
`FALSE` before. The watcher reads the value and its `ETag`, then long-polls with
`?wait_for_change=true&last_etag=<etag>&timeout_sec=<n>` so the server answers as soon as the
value changes. Errors are retried every `retry_s`.
"""

from __future__ import annotations

import logging
import os
import threading

import httpx

from infra.watchers.supervisor import PreemptionNotice

log = logging.getLogger(__name__)

GCE_METADATA_URL = "http://metadata.google.internal"
METADATA_HOST_ENV = "GCE_METADATA_HOST"
"""The variable google-auth also honours to reach the metadata server at another `host[:port]`."""


def default_metadata_url() -> str:
    """`http://$GCE_METADATA_HOST` when that is set, else the metadata server's usual address."""
    host = os.environ.get(METADATA_HOST_ENV)
    return f"http://{host}" if host else GCE_METADATA_URL


PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
HEADERS = {"Metadata-Flavor": "Google"}


class GcePreemptionWatcher:
    """Waits for `instance/preempted` to become TRUE."""

    def __init__(self, base_url: str = GCE_METADATA_URL, *, wait_timeout_s: int = 60, retry_s: float = 1.0) -> None:
        """`wait_timeout_s`: the longest one long poll is held by the server (`timeout_sec`)."""
        self.url = base_url.rstrip("/") + PREEMPTED_PATH
        self._wait_timeout_s = wait_timeout_s
        self._retry_s = retry_s

    def wait_for_notice(self, stop: threading.Event) -> PreemptionNotice | None:
        etag: str | None = None
        with httpx.Client(headers=HEADERS, timeout=self._wait_timeout_s + 10) as http:
            while not stop.is_set():
                params = (
                    {}
                    if etag is None
                    else {
                        "wait_for_change": "true",
                        "last_etag": etag,
                        "timeout_sec": str(self._wait_timeout_s),
                    }
                )
                try:
                    response = http.get(self.url, params=params)
                    response.raise_for_status()
                except httpx.HTTPError as error:
                    log.warning("metadata server: %s; retrying in %.0f s", error, self._retry_s)
                    stop.wait(self._retry_s)
                    continue
                if response.headers.get("Metadata-Flavor") != "Google":
                    log.warning("%s did not answer as the GCE metadata server; retrying", self.url)
                    stop.wait(self._retry_s)
                    continue
                if response.text.strip() == "TRUE":
                    return PreemptionNotice("gce-metadata")
                etag = response.headers.get("ETag", etag)
        return None

    def acknowledge(self, notice: PreemptionNotice) -> None:
        """GCE takes no acknowledgement: the VM stops when its notice period ends."""
