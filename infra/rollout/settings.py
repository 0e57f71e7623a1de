"""The rollout worker's settings: the one model every path derives them from.

`WorkerSettings` is the run configuration's `fabric.worker` section. The fabric turns it into the
`rlboost worker` flags of a local instance (`worker_flags`), the Prefect-backed instances pass it
as the `worker` parameter of their `rollout-instance` flow run, and `rlboost worker` builds its
flags from its fields (`add_worker_flags` / `settings_from_flags`), so a field's name, type,
default and description are written here once.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from pydantic import Field, model_validator

from rl.config import Section


class WorkerSettings(Section):
    """How each rollout instance runs (passed to `rlboost worker`)."""

    slots: int = Field(default=64, ge=1)
    """Samples an instance generates concurrently."""
    flush_tokens: int = Field(default=4, ge=1)
    """Flush a sample's tokens to the log every this many tokens."""
    flush_ms: float = Field(default=100.0, gt=0)
    """... or once its oldest unflushed token is this old."""
    heartbeat_s: float = Field(default=0.5, gt=0)
    """Seconds between heartbeats."""
    ttl_s: float = Field(default=2.0, gt=0)
    """Lifetime of the instance's liveness key in the registry, refreshed by each heartbeat (the
    fabric waits for a live instance by it). Reaping is `controller.reap_timeout_s`'s."""
    restart_from_scratch: bool = False
    """Baseline for benchmarks: instances never resume a sample from its logged tokens (they
    discard them on release, `infra.rollout.worker.WorkerConfig.restart_from_scratch`)."""

    @model_validator(mode="after")
    def _heartbeat_within_ttl(self) -> WorkerSettings:
        if self.ttl_s <= self.heartbeat_s:
            raise ValueError(
                f"ttl_s ({self.ttl_s}) must exceed heartbeat_s ({self.heartbeat_s}), or the "
                "instance lapses between heartbeats"
            )
        return self


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def worker_flags(settings: WorkerSettings) -> list[str]:
    """The `rlboost worker` flags that reproduce `settings`."""
    flags: list[str] = []
    for name, value in settings.model_dump().items():
        if isinstance(value, bool):
            flags += [_flag(name)] if value else []
        else:
            flags += [_flag(name), str(value)]
    return flags


_FLAG_TYPES: dict[Any, Callable[[str], Any]] = {int: int, float: float, str: str}
"""How a flag's text becomes the value of a field of each (non-bool) annotation."""


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `WorkerSettings` field, with its default and description."""
    for name, field in WorkerSettings.model_fields.items():
        help_text = (field.description or "").replace("%", "%%")
        if field.annotation is bool:
            parser.add_argument(_flag(name), action="store_true", default=field.default, help=help_text)
        else:
            parser.add_argument(
                _flag(name),
                type=_FLAG_TYPES[field.annotation],
                default=field.default,
                help=f"{help_text} (default {field.default})",
            )


def settings_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The `WorkerSettings` fields parsed by the flags of `add_worker_flags`."""
    return {name: getattr(args, name) for name in WorkerSettings.model_fields}
