"""The run's Prefect events (`rlboost.instance.preempted`, `rlboost.instance.replaced`,
`rlboost.weights.published`), emitted once each and read back from a real Prefect server's event
API with the run as their related resource."""

from __future__ import annotations

import uuid

import pytest

from infra.providers.interface import InstanceRecord
from infra.run.fleet_events import PREEMPTED, PUBLISHED, REPLACED, FleetEvents, run_resource_id
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


def _record(instance_id: str, reason: str | None) -> InstanceRecord:
    return InstanceRecord(
        instance_id=instance_id,
        pool="local-spot",
        capacity_class="spot",
        machine_type="local",
        price_per_hour=0.1,
        launched_at=0.0,
        state="terminated" if reason else "running",
        reason=reason,  # pyright: ignore[reportArgumentType]
    )


def test_fleet_events_reach_prefect_once_each(prefect_harness) -> None:
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter
    from prefect.events.worker import EventsWorker

    run_name = f"events-{uuid.uuid4().hex[:8]}"
    events = FleetEvents(run_name, run_id=f"{run_name}-1a2b")
    records = [_record("spot-1", "preempted"), _record("spot-2", None), _record("spot-3", "preempted_silent")]
    events.observe(records, replaced=1)
    events.observe(records, replaced=2)  # the same preemptions again: not emitted twice
    events.published(3, "ab" * 32)
    EventsWorker.drain_all()  # the events worker sends in the background

    def read() -> list:
        with get_client(sync_client=True) as client:
            page = client.read_events(
                EventFilter(
                    event=EventNameFilter(prefix=["rlboost."]),
                    related=EventRelatedFilter(id=[run_resource_id(run_name)]),
                ),
                limit=50,
            )
        return page.events

    wait_for(lambda: len(read()) >= 5, "the five events", timeout_s=30)
    found = read()
    assert len(found) == 5
    by_name: dict[str, list] = {}
    for event in found:
        by_name.setdefault(event.event, []).append(event)
    assert sorted(e.resource.id for e in by_name[PREEMPTED]) == ["rlboost.instance.spot-1", "rlboost.instance.spot-3"]
    assert sorted(e.payload["replaced"] for e in by_name[REPLACED]) == [1, 2]
    (published,) = by_name[PUBLISHED]
    assert published.payload == {"version": 3, "weights_sha": "ab" * 32}
    assert all(e.related[0].id == run_resource_id(run_name) and e.related[0].role == "run" for e in found)
