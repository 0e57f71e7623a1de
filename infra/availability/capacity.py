"""The capacity classes an instance can belong to (one owner: pools, the registry, the policies
and the price catalog all use this type)."""

from typing import Literal

CapacityClass = Literal["reserved", "ondemand", "spot"]
"""reserved: the training cluster's own machines; ondemand: bought by the hour; spot: preemptible."""
