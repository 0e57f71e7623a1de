"""The `rl-step` subflows send flow-run heartbeats only where something can watch them: Prefect
joins a flow run's heartbeat thread (1 s sleeps) when the run ends, which cost every step up to a
second on the driver's own ephemeral server, where nothing reads heartbeats."""

from __future__ import annotations

from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    get_current_settings,
    temporary_settings,
)

from flows.step_settings import step_settings


def test_no_step_heartbeats_on_the_drivers_own_ephemeral_server():
    with temporary_settings({PREFECT_API_URL: None, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 180}):
        with step_settings():
            assert get_current_settings().flows.heartbeat_frequency is None
        assert get_current_settings().flows.heartbeat_frequency == 180  # the rl-train run keeps its own


def test_step_heartbeats_as_configured_on_a_real_server():
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api", PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):
        with step_settings():
            assert get_current_settings().flows.heartbeat_frequency == 30
