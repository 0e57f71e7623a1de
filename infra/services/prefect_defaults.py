"""The embedded-friendly Prefect defaults, set (without overriding the environment) on import,
before Prefect itself is imported: a generous ephemeral-server start-up timeout, no telemetry."""

import os

for _name, _value in {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}.items():
    os.environ.setdefault(_name, _value)
