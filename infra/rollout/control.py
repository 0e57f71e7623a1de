"""The control messages the controller and the fleet send a rollout worker (docs/internals.md §3):
one typed record per kind, their JSON form on an instance's control list, and `ROUTE_S`, the one
default of how long a stolen sample waits for the instance it was stolen for.

Pure: no Redis, no runtime (the controller's policies and the simulator read `ROUTE_S`). The
registry queues `encode(message)` and hands `decode(text)` back; a message of a kind this version
does not know decodes to `Unknown`, which the worker logs and ignores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ROUTE_S = 5.0
"""Seconds a stolen sample waits (on the Redis server's clock) for its receiver to claim it."""


@dataclass(frozen=True)
class Release:
    """Hand back running samples (a steal): the named ones, or the `count` with the most work left."""

    sample_ids: tuple[str, ...] | None = None
    count: int = 0
    to: str | None = None
    """The instance the released samples are routed to (None: any instance may claim them)."""
    route_s: float = ROUTE_S


@dataclass(frozen=True)
class ReleaseAll:
    """Hand back every sample and claim none of `step` (the reserved instances at `T_local`)."""

    step: int | None = None
    """The step paused (None: the worker's current step)."""


@dataclass(frozen=True)
class Resume:
    """End a `ReleaseAll` pause."""

    step: int | None = None


@dataclass(frozen=True)
class Drain:
    """Finish: flush, hand everything back, deregister and exit 0."""


@dataclass(frozen=True)
class Unknown:
    """A message this version cannot read (logged and ignored by the worker)."""

    text: str


ControlMessage = Release | ReleaseAll | Resume | Drain
_OPS: dict[type, str] = {Release: "release", ReleaseAll: "release_all", Resume: "resume", Drain: "drain"}


def encode(message: ControlMessage) -> str:
    """The message's JSON form: its fields and ``"op"``, the kind."""
    fields: dict[str, Any] = {k: v for k, v in vars(message).items() if v is not None}
    if isinstance(message, Release) and message.sample_ids is not None:
        fields["sample_ids"] = list(message.sample_ids)
    return json.dumps({"op": _OPS[type(message)], **fields})


def decode(text: str | bytes) -> ControlMessage | Unknown:
    """The message `encode` made (`Unknown` for any other text)."""
    raw = text.decode() if isinstance(text, bytes) else text
    try:
        fields = json.loads(raw)
        op = fields.pop("op")
        if op == "release":
            ids = fields.pop("sample_ids", None)
            return Release(sample_ids=None if ids is None else tuple(map(str, ids)), **fields)
        kind = {"release_all": ReleaseAll, "resume": Resume, "drain": Drain}[op]
        return kind(**fields)
    except (ValueError, KeyError, TypeError, AttributeError):
        return Unknown(raw)
