"""Prefect settings and heartbeats of the `rl-step` subflow runs: heartbeats only where something
watches them, and never a wait for them when a step ends."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar, copy_context

from prefect import __version__ as prefect_version
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext
from prefect.events import emit_event
from prefect.events.related import tags_as_related_resources
from prefect.events.schemas.events import RelatedResource
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, get_current_settings, temporary_settings

from infra.services.prefect_api import current_api_url

log = logging.getLogger(__name__)

HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"
"""The event Prefect's flow engine sends for a running flow run, which the zombie automation
(deployments/automations/crash-zombie-flow-runs.yaml) expects again within 90 s."""

HEARTBEAT_THREAD = "rl-step-heartbeats"
"""The name of the thread that sends a step's heartbeats."""

_step_heartbeat_s: ContextVar[int | None] = ContextVar("rl_step_heartbeat_s", default=None)
"""Seconds between the heartbeats of the `rl-step` runs started in this context; None: none."""


def step_settings() -> ExitStack:
    """Prefect settings of the `rl-step` subflow runs (the `rl-train` run's own heartbeats have
    started before they apply). Prefect's own heartbeat thread is off for the steps: when a flow
    run ends, Prefect joins that thread, which sleeps in 1 s slices, so every step waited up to a
    second for it (an empty subflow took 1.14 s with it and 0.20 s without on 2 cores). On a real
    server the steps send the same heartbeats from `step_heartbeats`, whose thread stops at once;
    on the driver's own ephemeral server (no PREFECT_API_URL: `rlboost demo`, `rlboost train`)
    nothing watches heartbeats and the server ends with the driver, so they send none."""
    configured = None if current_api_url() is None else get_current_settings().flows.heartbeat_frequency
    settings = ExitStack()
    settings.enter_context(temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}))
    settings.callback(_step_heartbeat_s.reset, _step_heartbeat_s.set(configured))
    return settings


@contextmanager
def step_heartbeats() -> Iterator[None]:
    """Inside an `rl-step` run: its heartbeat event now and every `flows.heartbeat_frequency`
    seconds (as `step_settings` found it), as Prefect's flow engine sends them, from a thread that
    ends as soon as the step's work does."""
    seconds = _step_heartbeat_s.get()
    context = FlowRunContext.get()
    if seconds is None or context is None or context.flow_run is None:
        yield
        return
    resource, related = _heartbeat_template(context.flow_run, context.flow.name if context.flow else "")
    stopped = threading.Event()

    def beat() -> None:
        while True:
            try:
                emit_event(event=HEARTBEAT_EVENT, resource=resource, related=related)
            except Exception:  # as Prefect's own heartbeat thread: a lost beat is not the step's failure
                log.debug("could not send the heartbeat of %s", resource["prefect.resource.id"], exc_info=True)
            if stopped.wait(seconds):
                return

    thread = threading.Thread(target=copy_context().run, args=(beat,), name=HEARTBEAT_THREAD, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stopped.set()
        thread.join()


def _heartbeat_template(run: FlowRun, flow_name: str) -> tuple[dict[str, str], list[RelatedResource]]:
    """The heartbeat's resource (the flow run) and related resources (its flow, deployment and
    tags), as Prefect's flow engine builds them."""
    resource = {
        "prefect.resource.id": f"prefect.flow-run.{run.id}",
        "prefect.resource.name": run.name or "",
        "prefect.version": prefect_version,
    }
    related = [
        RelatedResource.model_validate(
            {
                "prefect.resource.id": f"prefect.flow.{run.flow_id}",
                "prefect.resource.role": "flow",
                "prefect.resource.name": flow_name,
            }
        )
    ]
    if run.deployment_id:
        related.append(
            RelatedResource.model_validate(
                {
                    "prefect.resource.id": f"prefect.deployment.{run.deployment_id}",
                    "prefect.resource.role": "deployment",
                }
            )
        )
    return resource, related + tags_as_related_resources(set(run.tags or []))
