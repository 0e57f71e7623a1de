"""Prefect settings of the `rl-step` subflow runs: heartbeats only where something watches them."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

from infra.services.prefect_api import current_api_url


def step_settings() -> AbstractContextManager:
    """Prefect settings of the `rl-step` subflow runs (the `rl-train` run's own heartbeats have
    started before they apply). When a flow run ends, Prefect joins its heartbeat thread, which
    sleeps in 1 s slices: every step would wait up to a second for it (an empty subflow took
    1.14 s with heartbeats and 0.20 s without on 2 cores). On the driver's own ephemeral server
    (no PREFECT_API_URL: `rlboost demo`, `rlboost train`) nothing watches heartbeats and the
    server ends with the driver, so the step subflows send none; on a real server they send them
    like every flow run, for zombie detection."""
    if current_api_url() is None:
        return temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})
    return nullcontext()
