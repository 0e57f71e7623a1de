"""Providers of instances for pools: the pool schema (`pool`), the interface (`interface`), the
shared zonal cloud implementation (`zonal`) and the providers (`local`, `gcp`, `azure`, `composite`)."""

from infra.providers.interface import InstanceHandle, InstanceRecord, PreemptionEvent, Provider
from infra.providers.local import LocalProvider
from infra.providers.pool import PoissonAvailability, PoolSpec, TraceAvailability

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
