"""The `rl-step` runs' heartbeats on a real Prefect server (the session's harness): the same event
Prefect's flow engine sends for a flow run, sent from a thread that ends with the step's work, so
a step no longer waits for Prefect's heartbeat thread (1 s sleeps) when it ends."""

from __future__ import annotations

import threading
from uuid import UUID

import pytest
from prefect import flow, tags
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

from flows.step_settings import HEARTBEAT_EVENT, HEARTBEAT_THREAD, step_heartbeats, step_settings
from tests.helpers import wait_for

pytestmark = pytest.mark.integration


@flow(name="engine-heartbeats", persist_result=False)
def with_the_engines_heartbeats() -> str:
    return flow_run.id


@flow(name="step-heartbeats", persist_result=False)
def with_step_heartbeats() -> tuple[str, int | None, list[str]]:
    with step_heartbeats():
        beating = [thread.name for thread in threading.enumerate()]
        return flow_run.id, get_current_settings().flows.heartbeat_frequency, beating


def _heartbeats(run_id: str) -> list[dict]:
    """The heartbeat events of flow run `run_id` the server has stored."""
    query = {
        "filter": {"event": {"name": [HEARTBEAT_EVENT]}, "resource": {"id": [f"prefect.flow-run.{run_id}"]}},
        "limit": 50,
    }
    with get_client(sync_client=True) as client:
        return client.request("POST", "/events/filter", json=query).json()["events"]


def _flow_run_name(run_id: str) -> str:
    """The name the server gave flow run `run_id`."""
    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(run_id)).name


def _stored_heartbeat(run_id: str) -> dict:
    found: list[dict] = []
    wait_for(lambda: found.extend(_heartbeats(run_id)) or found, f"a heartbeat of flow run {run_id}", timeout_s=60)
    assert len(found) == 1, found  # one at the start: the next would be 30 s later
    return found[0]


def _shape(event: dict, run_id: str, flow_name: str) -> tuple:
    """The event with this run's own ids and names taken out."""
    resource = {k: v.replace(run_id, "RUN") for k, v in event["resource"].items() if k != "prefect.resource.name"}
    related = sorted(
        (r["prefect.resource.role"], r.get("prefect.resource.name", "").replace(flow_name, "FLOW"))
        for r in event["related"]
    )
    return resource, related


def test_a_step_sends_the_heartbeat_prefects_engine_sends_and_leaves_no_thread(prefect_harness):
    with tags("rlboost"), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):
        engine_run = with_the_engines_heartbeats()
        with step_settings():
            step_run, frequency_in_the_step, threads_in_the_step = with_step_heartbeats()
    assert frequency_in_the_step is None, "Prefect's own heartbeat thread ran in the step"
    assert HEARTBEAT_THREAD in threads_in_the_step
    assert HEARTBEAT_THREAD not in [thread.name for thread in threading.enumerate()]
    theirs, ours = _stored_heartbeat(engine_run), _stored_heartbeat(step_run)
    assert _shape(ours, step_run, "step-heartbeats") == _shape(theirs, engine_run, "engine-heartbeats")
    assert "prefect.tag.rlboost" in [related["prefect.resource.id"] for related in ours["related"]]
    assert ours["resource"]["prefect.resource.name"] == _flow_run_name(step_run)


def test_no_step_heartbeats_without_a_server_url(prefect_harness, monkeypatch):
    """The driver's own ephemeral server: `step_settings` finds no PREFECT_API_URL, no heartbeats."""
    monkeypatch.setattr("flows.step_settings.current_api_url", lambda: None)
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}), step_settings():
        step_run, frequency_in_the_step, threads_in_the_step = with_step_heartbeats()
    assert frequency_in_the_step is None
    assert HEARTBEAT_THREAD not in threads_in_the_step
    assert _heartbeats(step_run) == []
