"""Prefect's own heartbeat thread is off in the `rl-step` runs, with or without a server: when a flow
run ends, Prefect joins that thread, which sleeps in 1 s slices, so every step waited up to a second
for it. On a real server the steps send their heartbeats from `flows.step_settings.step_heartbeats`
(tests/flows/test_step_heartbeats.py); the `rl-train` run keeps Prefect's own."""

from __future__ import annotations

import pytest
from prefect.settings import (
    PREFECT_API_URL,
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    get_current_settings,
    temporary_settings,
)

from flows.step_settings import step_settings


@pytest.mark.parametrize("api_url", [None, "http://127.0.0.1:4200/api"], ids=["ephemeral server", "real server"])
def test_prefects_heartbeat_thread_is_off_in_the_steps(api_url):
    with temporary_settings({PREFECT_API_URL: api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 180}):
        with step_settings():
            assert get_current_settings().flows.heartbeat_frequency is None
        assert get_current_settings().flows.heartbeat_frequency == 180  # the rl-train run keeps its own
