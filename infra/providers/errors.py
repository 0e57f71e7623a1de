"""Errors of cloud providers: what a caller must fix, and what the provider works around.

`PoolConfigError` and `CredentialsError` stop the capacity manager: they name the pool and say
what to change. `ZoneUnavailable` never leaves a provider: it is a zone (or its whole region, for
quota) that cannot take more instances right now, and makes the provider fail over to the pool's
next zone and back off from this one.
"""

from __future__ import annotations

from typing import Literal


class CloudError(RuntimeError):
    """A cloud provider could not do what a pool needs; the message names the pool and the fix."""

    def __init__(self, pool: str, message: str) -> None:
        super().__init__(f"pool {pool!r}: {message}")
        self.pool = pool


class PoolConfigError(CloudError):
    """The pool's settings are wrong for the cloud (unknown project, machine type, image, ...)."""


class CredentialsError(CloudError):
    """The cloud rejected (or could not find) the credentials, or they lack a permission."""


UnavailableKind = Literal["capacity", "quota", "transient"]


class ZoneUnavailable(Exception):
    """A zone cannot take instances now: out of capacity, over quota, or an API hiccup."""

    def __init__(self, zone: str, kind: UnavailableKind, detail: str) -> None:
        """`detail`: the cloud's own error code and message."""
        super().__init__(f"{zone}: {kind}: {detail}")
        self.zone = zone
        self.kind = kind
        self.detail = detail
