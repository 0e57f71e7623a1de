"""A rollout instance's identity, `InstanceSpec`, written once: the worker's configuration holds one,
the registry records and reads one, the co-located instance and the ``rollout-instance`` flow build
one, from its pool (`of_pool`). How many samples it generates at once is the run's
`WorkerSettings.slots`, not its identity.
"""

from __future__ import annotations

import os
import socket
from typing import Protocol

from pydantic import Field, field_validator

from infra.availability.capacity import CapacityClass
from rl.config import Section


class PoolLike(Protocol):
    """What `InstanceSpec.of_pool` reads: the fields of `infra.providers.pool.PoolSpec`."""

    @property
    def name(self) -> str: ...
    @property
    def capacity_class(self) -> CapacityClass: ...
    @property
    def price_per_hour(self) -> float: ...


class InstanceSpec(Section):
    """Who a rollout instance is: its id, its pool, its capacity class and its price."""

    instance_id: str
    """Unique id of the instance in its run (the registry key and the owner of its leases)."""
    pool: str = Field(min_length=1)
    """The pool the instance belongs to (provider, zone, machine type, class)."""
    capacity_class: CapacityClass = "spot"
    """reserved, ondemand or spot."""
    price_per_hour: float = Field(default=0.0, ge=0)
    """What the instance costs, USD per hour (recorded in the registry, seen by the policies)."""

    @field_validator("instance_id")
    @classmethod
    def _printable_id(cls, value: str) -> str:
        if not value or not value.isprintable():
            raise ValueError(f"instance_id must be non-empty and printable: {value!r}")
        return value

    @classmethod
    def of_pool(cls, instance_id: str, pool: PoolLike) -> InstanceSpec:
        """An instance of `pool`: its name, capacity class and price."""
        return cls(
            instance_id=instance_id,
            pool=pool.name,
            capacity_class=pool.capacity_class,
            price_per_hour=pool.price_per_hour,
        )


def default_instance_id(pool: str) -> str:
    """The id of an instance started without one: ``<pool>-<host>-<pid>``."""
    return f"{pool}-{socket.gethostname()}-{os.getpid()}"
