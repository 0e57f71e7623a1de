"""Providers of instances for pools: the interface (`base`) and its implementations (`local`)."""

from infra.providers.base import (
    InstanceHandle,
    InstanceRecord,
    PoissonAvailability,
    PoolSpec,
    PreemptionEvent,
    Provider,
    TraceAvailability,
)
from infra.providers.local import LocalProvider

__all__ = [
    "InstanceHandle",
    "InstanceRecord",
    "LocalProvider",
    "PoissonAvailability",
    "PoolSpec",
    "PreemptionEvent",
    "Provider",
    "TraceAvailability",
]
