"""Marginal-value fleet sizing (`infra.rollout.policies.marginal`) on hand-made throughput curves,
and the offload controller's throughput curve it reads. Pure: no I/O."""

from __future__ import annotations

import json
import math

import pytest

from infra.rollout.controller_config import OffloadSettings
from infra.rollout.policies import (
    CapacityConfig,
    CapacityTarget,
    MarginalConfig,
    OffloadController,
    PoolOffer,
    StepTiming,
    plan_marginal,
)
from infra.rollout.policies.marginal import estimate
from infra.rollout.policies.offload import CURVE_MIN_STEPS, CURVE_WARMUP_STEPS

UNLIMITED = CapacityConfig(budget_per_hour=1e9, warmup_s=1200.0)


def spot(price: float = 1.0, size: int = 4, **kwargs) -> PoolOffer:
    return PoolOffer("spot", price, 1.0, max_instances=size, **kwargs)


def target(curve: dict[int, float], *, price: float = 1.0, base: float = 10.0, held: int = 0, **kwargs) -> int:
    config = kwargs.pop("config", UNLIMITED)
    marginal = MarginalConfig(base_price_per_hour=base, **kwargs)
    (planned,) = plan_marginal((spot(price),), config, marginal, curve, held)
    return planned.target


def test_flat_curve_adds_no_instance():
    assert target({0: 100.0, 1: 100.0}) == 0
    assert target({0: 100.0, 1: 99.0}, held=1) == 0  # a held one that adds nothing is released


def test_steep_curve_grows_one_unmeasured_instance_at_a_time():
    assert target({0: 100.0}) == 1  # the first instance is always explored
    assert target({0: 100.0, 1: 150.0}) == 2  # its gain, assumed again, still beats the bar
    assert target({0: 100.0, 1: 150.0, 2: 200.0}) == 3
    assert target({0: 100.0, 1: 150.0, 2: 200.0, 3: 250.0, 4: 300.0}) == 4  # the pool's size


def test_concave_curve_stops_where_the_next_instance_costs_more_than_it_earns():
    # base $10/h, $1/h each: tokens/$ at 2 = 200 / 12 = 16.7; the third adds 10 / $1 < 16.7
    assert target({0: 100.0, 1: 150.0, 2: 200.0, 3: 210.0}) == 2
    assert target({0: 100.0, 1: 150.0, 2: 200.0, 3: 210.0}, held=3) == 2  # released


def test_price_rise_releases_instances():
    curve = {0: 100.0, 1: 150.0, 2: 200.0}
    assert target(curve, price=1.0, held=2) == 3
    # at $10/h an instance adds 50 / 10 = 5 tokens per dollar, the run alone makes 100 / 10 = 10
    assert target(curve, price=10.0, held=2) == 0


def test_budget_ceiling_holds():
    curve = {0: 100.0, 1: 150.0, 2: 200.0, 3: 250.0, 4: 300.0}
    assert target(curve, config=CapacityConfig(budget_per_hour=2.5, warmup_s=1200.0)) == 2
    capped = plan_marginal((spot(price_cap=0.5),), UNLIMITED, MarginalConfig(base_price_per_hour=10.0), curve, held=0)
    assert capped == (CapacityTarget("spot", 0),)


def test_preemptions_and_boot_time_discount_the_gain():
    curve = {0: 100.0, 1: 112.0}
    assert target(curve) == 2  # 12 tokens per dollar against the run's 10: one more explored
    # 6 preemptions an hour, 20 minutes each to boot and load: productive a third of the time
    (churny,) = plan_marginal(
        (spot(preemptions_per_hour=6.0),), UNLIMITED, MarginalConfig(base_price_per_hour=10.0), curve, held=1
    )
    assert churny.target == 0


def test_egress_counts_as_price():
    curve = {0: 100.0, 1: 112.0}
    assert target(curve, egress_usd_per_hour={"spot": 0.5}) == 0  # 12 / 1.5 = 8 < 10


def test_hold_margin_keeps_a_held_instance_near_the_bar():
    curve = {0: 100.0, 1: 109.8}  # adds 9.8 tokens per dollar against 10: 2% under the bar
    assert target(curve, held=0) == 0
    assert target(curve, held=1) == 1
    assert target(curve, held=1, hold_margin=0.0) == 0


def test_a_run_that_makes_nothing_without_spot_grows_from_zero():
    assert target({0: 0.0}, base=0.0) == 1
    assert target({0: 0.0, 1: 50.0}, base=0.0) == 2
    assert target({0: 0.0, 1: 50.0, 2: 60.0}, base=0.0, held=2) == 1  # 10 / $1 against 50 / $1


def test_nothing_measured_holds_only_the_minimum():
    (planned,) = plan_marginal(
        (spot(min_instances=2),), UNLIMITED, MarginalConfig(base_price_per_hour=10.0), {}, held=0
    )
    assert planned.target == 2
    assert target({}) == 0
    assert target({3: 400.0}, held=3) == 0  # the reserved cluster alone is not measured yet


def test_instances_follow_the_ranking_across_pools():
    cheap = PoolOffer("cheap", 1.0, 1.0, max_instances=1)
    dear = PoolOffer("dear", 3.0, 1.0, max_instances=3)
    curve = {0: 100.0, 1: 150.0, 2: 200.0, 3: 250.0}
    marginal = MarginalConfig(base_price_per_hour=10.0)
    # the cheap pool's instance first; then $3/h ones adding 50 / 3 = 16.7 tokens per dollar
    # while the run makes 150 / 11 = 13.6, 200 / 14 = 14.3, then not 250 / 17 = 14.7 ... all pass
    assert plan_marginal((dear, cheap), UNLIMITED, marginal, curve, held=0) == (
        CapacityTarget("dear", 3),
        CapacityTarget("cheap", 1),
    )
    pricier = PoolOffer("dear", 6.0, 1.0, max_instances=3)
    assert plan_marginal((pricier, cheap), UNLIMITED, marginal, curve, held=0) == (
        CapacityTarget("dear", 0),
        CapacityTarget("cheap", 1),
    )


def test_egress_ranks_pools_of_one_price_and_counts_in_an_instances_cost():
    near = PoolOffer("near", 1.0, 1.0, max_instances=2)
    far = PoolOffer("far", 1.0, 1.0, max_instances=2)
    curve = {0: 100.0, 1: 150.0, 2: 200.0, 3: 250.0, 4: 300.0}
    # both near ones first; then a far one adds 50 tokens for $1 + $3 of egress = 12.5 a dollar,
    # under the run's 200 / $12 = 16.7
    marginal = MarginalConfig(base_price_per_hour=10.0, egress_usd_per_hour={"far": 3.0})
    assert plan_marginal((far, near), UNLIMITED, marginal, curve, held=0) == (
        CapacityTarget("far", 0),
        CapacityTarget("near", 2),
    )


def test_estimate_interpolates_and_extrapolates_one_step():
    curve = {0: 100.0, 2: 200.0}
    assert estimate(curve, 1) == 150.0
    assert estimate(curve, 3) == 250.0
    assert estimate(curve, 4) is None
    assert estimate({0: 100.0}, 1) == math.inf
    assert estimate({}, 0) is None


def test_marginal_config_rejects_bad_values():
    with pytest.raises(ValueError):
        MarginalConfig(base_price_per_hour=-1.0)
    with pytest.raises(ValueError):
        MarginalConfig(base_price_per_hour=1.0, hold_margin=1.0)


# --- the curve the offload controller learns ------------------------------------------------


def step(n: int, throughput: float) -> StepTiming:
    return StepTiming(t_local_s=10.0, trainer_idle_s=0.0, rollout_idle_s=0.0, throughput=throughput, num_spot=n)


def test_offload_controller_learns_a_throughput_curve_and_keeps_it():
    c: OffloadController = OffloadSettings(initial_t_local_s=10.0).new_controller()
    assert c.throughput_curve() == {}
    c.update(step(2, 200.0))
    assert c.throughput_curve() == {}  # T_local's update alone does not feed the curve
    c.observe(0, 100.0)  # the reserved cluster alone: no T_local to tune, shown at once
    assert c.throughput_curve() == {0: 100.0}
    for _ in range(CURVE_WARMUP_STEPS):
        c.observe(2, 20.0)  # the warm-up: left out
    c.observe(2, 200.0)
    assert c.throughput_curve() == {0: 100.0}  # 2 is shown once observed in enough steps
    for _ in range(CURVE_MIN_STEPS - 1):
        c.observe(2, 300.0)
    curve = c.throughput_curve()
    assert curve[0] == 100.0 and 200.0 < curve[2] < 300.0  # a moving average, not the last step
    t_local = c.to_dict()["t_local"]
    c.observe(0, 50.0)
    assert c.to_dict()["t_local"] == t_local  # the curve teaches T_local nothing
    resumed = OffloadController.from_dict(json.loads(json.dumps(c.to_dict())))
    assert resumed.throughput_curve() == c.throughput_curve()
    state = c.to_dict()
    del state["curve"]  # a state saved before the curve existed
    assert OffloadController.from_dict(state).throughput_curve() == {}
