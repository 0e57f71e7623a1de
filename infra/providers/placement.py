"""Which GPUs of a node each local instance gets (`PoolSpec.gpus_per_instance`): a pure plan.

`plan_node` plans this machine. `node_devices` is the node's inventory as `CUDA_VISIBLE_DEVICES` names it (a declared count, else
what torch counts; mapped through the driver's own `CUDA_VISIBLE_DEVICES` when that is set).
`place(pools, devices)` gives each local pool with `gpus_per_instance` one `GpuSlot` per instance
it may hold (`size`): the in-process `colocated` pool first, from the first GPU (the trainer's), then
whole-GPU pools on GPUs no other instance uses, then shares first-fit on GPUs whose shares stay at
most 1. A pool that does not fit is refused with `PlacementError`, one line naming the pool, its
key and the node's GPUs. `infra.providers.local.LocalProvider` starts each instance in a free
slot of its pool with `GpuSlot.environment()`; the slot is free again once the instance exited.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infra.providers.pool import PoolSpec

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
SHARE_SLACK = 1e-9
"""Rounding allowed when shares add up to one GPU (three instances of 1/3)."""


class PlacementError(ValueError):
    """Pools that ask for more GPUs than the node has; the message names the pool and the key."""


@dataclass(frozen=True)
class GpuSlot:
    """The GPUs one instance runs on: `devices` as `CUDA_VISIBLE_DEVICES` names them, `share` of each."""

    devices: tuple[str, ...]
    share: float

    def environment(self) -> dict[str, str]:
        return {VISIBLE_DEVICES_ENV: ",".join(self.devices)}


def node_devices(declared: int | None, visible: str | None, count: Callable[[], int]) -> tuple[str, ...]:
    """The node's GPUs: `declared` (`fabric.node_gpus`) of them, else `count()` (torch's); named by
    the driver's `visible` (`CUDA_VISIBLE_DEVICES`) when set, else numbered from 0."""
    names = None if visible is None else tuple(name.strip() for name in visible.split(",") if name.strip())
    total = declared if declared is not None else count()
    if names is None:
        return tuple(str(index) for index in range(total))
    if total > len(names):
        raise PlacementError(
            f"fabric.node_gpus: {total} GPUs declared, but this process's CUDA_VISIBLE_DEVICES names "
            f"{len(names)} ({visible}): lower fabric.node_gpus or widen CUDA_VISIBLE_DEVICES"
        )
    return names[:total]


def plan_node(
    pools: Sequence[PoolSpec], declared: int | None, count: Callable[[], int]
) -> dict[str, tuple[GpuSlot, ...]]:
    """`place` on this machine: its GPUs from `node_devices` with this process's
    `CUDA_VISIBLE_DEVICES`; `count` (torch's) is not called when no local pool asks for GPUs."""
    if not any(pool.provider == "local" and pool.gpus_per_instance for pool in pools):
        return {}
    return place(pools, node_devices(declared, os.environ.get(VISIBLE_DEVICES_ENV), count))


def place(pools: Sequence[PoolSpec], devices: Sequence[str]) -> dict[str, tuple[GpuSlot, ...]]:
    """One slot per instance of every local pool with `gpus_per_instance` (`pools` is `fabric.pools`,
    whose positions name them in errors); `PlacementError` when they do not fit on `devices`."""
    used = [0.0] * len(devices)
    indexed = [(index, pool) for index, pool in enumerate(pools) if pool.provider == "local" and pool.gpus_per_instance]
    order = sorted(indexed, key=lambda item: (not item[1].colocated, item[1].gpus_per_instance < 1))
    plan: dict[str, tuple[GpuSlot, ...]] = {}
    for index, pool in order:
        slots = []
        for _ in range(pool.size):
            chosen = _whole(used, int(pool.gpus_per_instance)) if pool.gpus_per_instance >= 1 else _shared(used, pool)
            if chosen is None:
                raise PlacementError(_refusal(index, pool, pools, devices))
            for position in chosen:
                used[position] += min(pool.gpus_per_instance, 1.0)
            slots.append(GpuSlot(tuple(devices[p] for p in chosen), min(pool.gpus_per_instance, 1.0)))
        plan[pool.name] = tuple(slots)
    return {pool.name: plan[pool.name] for pool in pools if pool.name in plan}


def _whole(used: list[float], count: int) -> list[int] | None:
    free = [position for position, share in enumerate(used) if share == 0]
    return free[:count] if len(free) >= count else None


def _shared(used: list[float], pool: PoolSpec) -> list[int] | None:
    for position, share in enumerate(used):
        if share + pool.gpus_per_instance <= 1 + SHARE_SLACK:
            return [position]
    return None


def _refusal(index: int, pool: PoolSpec, pools: Sequence[PoolSpec], devices: Sequence[str]) -> str:
    asked = sum(p.size * p.gpus_per_instance for p in pools if p.provider == "local")
    return (
        f"fabric.pools[{index}] ({pool.name}).gpus_per_instance: {pool.size} instances of {pool.gpus_per_instance:g} "
        f"GPUs each do not fit on this node's {len(devices)} GPUs (fabric.node_gpus) beside the other local pools "
        f"({asked:g} GPUs asked for in all): lower size or gpus_per_instance, or declare more fabric.node_gpus"
    )
