"""Prefect events for a run's fleet and weights, so that automations can hang on them:
`rlboost.instance.preempted` (one per preempted instance), `rlboost.instance.replaced` (one per
failed instance replaced) and `rlboost.weights.published` (one per policy version, with its
weights sha), each with the run (`rlboost.run.<run.name>`) as a related resource.

`FleetEvents` is fed by the fabric: `observe` from its health check (the providers' records and the
instance watch's count), `published` from the publisher's encoding thread. `emit_event` only queues
the event for Prefect's background client; a failure to emit is logged once and never fails or
slows the run. Without a Prefect API (`current_api_url()` None: a fabric used outside a flow)
nothing is emitted, so that no ephemeral server is started for an event.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prefect.events import emit_event

from infra.providers.interface import InstanceRecord
from infra.services.prefect_api import current_api_url

log = logging.getLogger(__name__)

PREEMPTED = "rlboost.instance.preempted"
REPLACED = "rlboost.instance.replaced"
PUBLISHED = "rlboost.weights.published"
PREEMPTION_REASONS = ("preempted", "preempted_silent")


def run_resource_id(run_name: str) -> str:
    """The run's Prefect resource id (`rlboost.checkpoint.saved` names the same)."""
    return f"rlboost.run.{run_name}"


class FleetEvents:
    """Emits each fleet event once (`observe` is called again and again with the same records)."""

    def __init__(self, run_name: str, run_id: str) -> None:
        self.run_name, self.run_id = run_name, run_id
        self._preempted: set[str] = set()
        self._replaced = 0
        self._warned = False
        self._enabled = current_api_url() is not None

    def observe(self, records: Iterable[InstanceRecord], replaced: int) -> None:
        """Emit the preemptions among `records` not emitted yet, and a replacement per count
        `replaced` (the instance watch's, run so far) has grown by."""
        if not self._enabled:
            return
        for record in records:
            if record.reason in PREEMPTION_REASONS and record.instance_id not in self._preempted:
                self._preempted.add(record.instance_id)
                self._emit(
                    PREEMPTED,
                    self._instance(record.instance_id, record.pool),
                    {"reason": record.reason, "capacity_class": record.capacity_class, "zone": record.zone},
                )
        for count in range(self._replaced + 1, replaced + 1):
            self._emit(REPLACED, {"prefect.resource.id": f"rlboost.fleet.{self.run_id}"}, {"replaced": count})
        self._replaced = max(self._replaced, replaced)

    def published(self, version: int, weights_sha: str) -> None:
        resource = {"prefect.resource.id": f"rlboost.weights.{self.run_id}.{version}", "rlboost.version": str(version)}
        self._emit(PUBLISHED, resource, {"version": version, "weights_sha": weights_sha})

    def _instance(self, instance_id: str, pool: str) -> dict[str, str]:
        return {"prefect.resource.id": f"rlboost.instance.{instance_id}", "rlboost.pool": pool}

    def _emit(self, event: str, resource: dict[str, str], payload: dict[str, Any]) -> None:
        if not self._enabled:
            return
        related = [
            {
                "prefect.resource.id": run_resource_id(self.run_name),
                "prefect.resource.role": "run",
                "rlboost.run-id": self.run_id,
            }
        ]
        try:
            emit_event(event=event, resource=resource, related=related, payload=payload)
        except Exception as exc:  # noqa: BLE001 - an event is never worth the run
            if not self._warned:
                log.warning("Prefect event %s not emitted (%s); the run goes on without events", event, exc)
                self._warned = True
