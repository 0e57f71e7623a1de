"""Marginal-value fleet sizing: how many spot instances are worth their price, from the step
throughput the run measured per spot count (`OffloadController.throughput_curve`).

`plan_capacity`'s targets stay the ceiling (budget, price caps, pool sizes); its ranking, with each
pool's weight egress per hour added to its price, orders the instances. The k-th instance is held
only while its marginal trained tokens per dollar beats the run's tokens per dollar with k - 1:
``(curve[k] - curve[k-1]) / churn / (price + egress) >= curve[k-1] / (base + the first k - 1
instances' prices and egress)``, where churn is `effective_throughput`'s ``1 +
preemptions_per_hour * warmup_h``. An instance already held keeps its place down to
``1 - hold_margin`` of that bar, so a noisy step does not flap the fleet.
Unmeasured counts: between two measured ones, interpolated; above the highest, one instance at
a time, the first one always (once the reserved cluster alone is measured), a later one if the
last measured instance's gain, assumed again (a concave curve), passes. With nothing measured
below it nothing beyond the pools' `min_instances` is held. Details: docs/internals.md §3.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from infra.rollout.policies.capacity import (
    CapacityConfig,
    CapacityTarget,
    PoolOffer,
    effective_throughput,
    plan_capacity,
    rank_key,
)


@dataclass(frozen=True)
class MarginalConfig:
    """What marginal sizing weighs beside the pools' offers."""

    base_price_per_hour: float
    """What the run pays per hour whatever its spot count: the trainer and reserved machines."""
    egress_usd_per_hour: Mapping[str, float] = field(default_factory=dict)
    """Per pool: what one instance's weight pulls cost in egress per hour (absent: 0)."""
    hold_margin: float = 0.05
    """An instance already held is kept down to this fraction below the bar (hysteresis)."""

    def __post_init__(self) -> None:
        if self.base_price_per_hour < 0 or not 0 <= self.hold_margin < 1:
            raise ValueError("need base_price_per_hour >= 0 and 0 <= hold_margin < 1")


def estimate(curve: Mapping[int, float], n: int) -> float | None:
    """Throughput at `n` spot instances: measured; else interpolated between the nearest measured
    counts around it; else, one above the highest measured, that count's value plus the last
    measured gain per instance (math.inf with a single measured count below: worth exploring);
    else None (unknown)."""
    if n in curve:
        return curve[n]
    below = [k for k in curve if k < n]
    above = [k for k in curve if k > n]
    if below and above:
        lo, hi = max(below), min(above)
        return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)
    if not below or max(below) != n - 1:
        return None
    top = n - 1
    lower = [k for k in below if k < top]
    if not lower:
        return math.inf
    prev = max(lower)
    return curve[top] + (curve[top] - curve[prev]) / (top - prev)


def worth_holding(
    slots: list[PoolOffer],
    floor: int,
    curve: Mapping[int, float],
    config: CapacityConfig,
    marginal: MarginalConfig,
    held: int,
) -> int:
    """How many of `slots` (instances in order, the first `floor` held whatever they add) to hold;
    `held`: how many are held now (they get the `hold_margin`)."""

    def cost(offer: PoolOffer) -> float:
        return offer.price_per_hour + marginal.egress_usd_per_hour.get(offer.pool, 0.0)

    count = floor
    spend = marginal.base_price_per_hour + sum(cost(o) for o in slots[:floor])
    while count < len(slots):
        before, after = estimate(curve, count), estimate(curve, count + 1)
        if before is None or after is None or math.isinf(before):
            break
        offer = slots[count]
        gain = (after - before) * effective_throughput(offer, config) / offer.throughput
        bar = before / spend if spend > 0 else (math.inf if before > 0 else 0.0)
        if count < held:
            bar *= 1 - marginal.hold_margin
        price = cost(offer)
        worth = gain > 0 and (price <= 0 or math.isinf(gain) or gain / price >= bar)
        if not worth:
            break
        count += 1
        spend += price
    return count


def _rank_key(offer: PoolOffer, config: CapacityConfig, marginal: MarginalConfig) -> tuple[float, float, float, str]:
    """`rank_key` with the pool's weight egress added to its price."""
    cost = offer.price_per_hour + marginal.egress_usd_per_hour.get(offer.pool, 0.0)
    _, availability, preemptions, name = rank_key(offer, config)
    return (cost / effective_throughput(offer, config), availability, preemptions, name)


def plan_marginal(
    offers: tuple[PoolOffer, ...],
    config: CapacityConfig,
    marginal: MarginalConfig,
    curve: Mapping[int, float],
    held: int,
) -> tuple[CapacityTarget, ...]:
    """One target per offer, in the offers' order: `plan_capacity`'s targets (the ceiling), cut to
    the first `worth_holding` instances in its ranking with each pool's egress added to its price
    (the pools' `min_instances` first). `curve`:
    step throughput per total spot count; `held`: spot instances running now."""
    ceiling = {t.pool: t.target for t in plan_capacity(offers, config)}
    ranked = sorted((o for o in offers if ceiling[o.pool]), key=lambda o: _rank_key(o, config, marginal))
    floors = {o.pool: min(o.min_instances, ceiling[o.pool]) for o in ranked}
    slots = [o for o in ranked for _ in range(floors[o.pool])]
    slots += [o for o in ranked for _ in range(ceiling[o.pool] - floors[o.pool])]
    count = worth_holding(slots, sum(floors.values()), curve, config, marginal, held)
    targets = Counter(o.pool for o in slots[:count])
    return tuple(CapacityTarget(o.pool, targets[o.pool]) for o in offers)
