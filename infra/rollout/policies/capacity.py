"""Capacity planning: how many spot instances to keep in each pool, from current prices, price
caps, recent availability and preemption history, and an hourly budget.

Pools are ranked by price per unit of effective throughput and filled greedily, cheapest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolOffer:
    """What is known now about one spot pool."""

    pool: str
    price_per_hour: float
    """Current price of one instance."""
    throughput: float
    """Generation throughput of one ready instance (e.g. tokens/s); > 0."""
    max_instances: int
    min_instances: int = 0
    price_cap: float | None = None
    """Never pay more than this per instance-hour: above it the pool's target is 0, even its
    minimum."""
    availability: float = 1.0
    """Fraction of recent instance requests in this pool that were fulfilled, in [0, 1]."""
    preemptions_per_hour: float = 0.0
    """Recent preemption rate per instance."""

    def __post_init__(self) -> None:
        if self.throughput <= 0 or not 0 <= self.min_instances <= self.max_instances:
            raise ValueError(f"{self.pool}: need throughput > 0 and 0 <= min_instances <= max_instances")


@dataclass(frozen=True)
class CapacityConfig:
    budget_per_hour: float
    """Ceiling on the summed hourly price of all targets, counted as if every request were
    fulfilled, so it holds whatever availability turns out to be."""
    max_total: int | None = None
    """Instances the rollout can use at all (e.g. queued samples / slots); None for no limit."""
    min_availability: float = 0.2
    """Pools whose requests were fulfilled less often than this are not asked for anything."""
    warmup_s: float = 120.0
    """Time a fresh instance spends before it generates (boot, weight pull); each preemption
    wastes it again."""


@dataclass(frozen=True)
class CapacityTarget:
    pool: str
    target: int


def effective_throughput(offer: PoolOffer, config: CapacityConfig) -> float:
    """Throughput discounted by preemption churn: with preemptions at rate r per hour and a
    warm-up of w hours per instance, a slot is productive a fraction 1 / (1 + r * w) of the time."""
    return offer.throughput / (1 + offer.preemptions_per_hour * config.warmup_s / 3600)


def rank_key(offer: PoolOffer, config: CapacityConfig) -> tuple[float, float, float, str]:
    """Price per effective throughput; ties: higher availability, fewer preemptions, pool name."""
    cost = offer.price_per_hour / effective_throughput(offer, config)
    return (cost, -offer.availability, offer.preemptions_per_hour, offer.pool)


def plan_capacity(offers: tuple[PoolOffer, ...], config: CapacityConfig) -> tuple[CapacityTarget, ...]:
    """One target per offer, in the offers' order.

    Pools over their price cap or under `min_availability` get 0. The others are taken in rank
    order (`rank_key`) twice: first up to their `min_instances`, then up to `max_instances`, each
    instance only while the budget and `max_total` allow it; a pool that cannot afford one more
    instance does not stop cheaper-priced pools further down the ranking from being filled.
    """
    usable = [
        o
        for o in offers
        if (o.price_cap is None or o.price_per_hour <= o.price_cap) and o.availability >= config.min_availability
    ]
    ranked = sorted(usable, key=lambda o: rank_key(o, config))
    targets = {o.pool: 0 for o in offers}
    spend = 0.0
    room = math.inf if config.max_total is None else config.max_total
    for limit in (lambda o: o.min_instances, lambda o: o.max_instances):
        for offer in ranked:
            affordable = (
                math.inf
                if offer.price_per_hour <= 0
                else math.floor((config.budget_per_hour - spend) / offer.price_per_hour + 1e-9)
            )
            add = int(max(0, min(limit(offer) - targets[offer.pool], affordable, room)))
            targets[offer.pool] += add
            spend += add * offer.price_per_hour
            room -= add
    return tuple(CapacityTarget(o.pool, targets[o.pool]) for o in offers)
