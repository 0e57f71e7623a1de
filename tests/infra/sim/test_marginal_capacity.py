"""The simulator's `marginal` capacity variant and its weight egress, on the small scenario: the
trace's capacity stays the ceiling, a price rise empties the pool, and every pull is billed."""

from __future__ import annotations

import pytest

from infra.pricing.egress import egress_usd_per_gb
from infra.sim.availability import spot_schedule
from infra.sim.runner import SPECS, measure
from infra.sim.scenario import egress_price, prices_per_hour
from infra.sim.simulator import Simulation, VariantSpec
from tests.infra.sim.test_simulator import small


def run(scenario, name: str):
    prices = prices_per_hour(scenario)[:2]
    return Simulation(scenario, SPECS[name], spot_schedule(scenario), prices).run()


@pytest.fixture(scope="module")
def longer():
    return small(run={"duration_s": 3600})


def test_marginal_never_holds_more_than_the_trace_allows(longer):
    schedule = spot_schedule(longer)
    result = run(longer, "rlboost_marginal")
    assert max(count for _, count in result.instance_counts) > 0  # cheap spot: it explores and holds
    for t, count in result.instance_counts:
        assert count <= min(schedule.capacity_at(t), longer.spot.max_instances), t
    budget = run(longer, "rlboost")
    assert measure(result, 0, None).mean_spot_instances <= measure(budget, 0, None).mean_spot_instances + 1e-9
    assert result.samples_done == result.samples_total > 0


def test_marginal_releases_spot_instances_not_worth_their_price():
    dear = small(run={"duration_s": 3600}, spot={"price_per_hour": 500})
    result = run(dear, "rlboost_marginal")
    assert result.instance_counts[-1][1] == 0  # explored once, then drained
    budget = run(dear, "rlboost")  # holds what the trace allows, whatever the price
    assert measure(result, 0, None).mean_spot_instances < 0.5 * measure(budget, 0, None).mean_spot_instances


def test_marginal_needs_the_runtime_offload_controller():
    with pytest.raises(ValueError, match="offload"):
        VariantSpec("x", use_spot=True, offload="artifact", capacity="marginal")


def test_weight_pulls_are_counted_and_billed():
    free = small(network={"weight_bytes_fraction": 0.25})
    billed = small(network={"weight_bytes_fraction": 0.25, "egress_usd_per_gb": 0.1})
    a, b = run(free, "rlboost"), run(billed, "rlboost")
    full = free.model.shape().weight_bytes
    sizes = {nbytes for _, nbytes in b.pulls}
    assert sizes == {full, full * 0.25}  # a booted instance pulls everything, then the deltas
    assert a.pulls == b.pulls  # the price does not change the budget policy's run
    ma, mb = measure(a, 0, None), measure(b, 0, None)
    assert ma.egress_usd == 0.0 and ma.egress_usd_per_step == 0.0
    assert mb.egress_usd == pytest.approx(sum(n for _, n in b.pulls) / 1e9 * 0.1)
    assert mb.cost_usd - ma.cost_usd == pytest.approx(mb.egress_usd)
    assert mb.egress_usd_per_step == pytest.approx(mb.egress_usd / mb.steps)


def test_egress_price_follows_the_regions():
    assert egress_price(small()) == 0.0  # both in us-central1
    assert egress_price(small(spot={"region": "us-east1"})) == 0.02
    assert egress_price(small(spot={"region": "europe-west4"})) == 0.05
    assert egress_price(small(spot={"provider": "azure", "region": "eastus"})) == 0.12
    assert egress_price(small(spot={"region": "europe-west4"}, network={"egress_usd_per_gb": 0.3})) == 0.3
    assert egress_usd_per_gb("local", None, "gcp", "us-central1") == 0.0
    assert egress_usd_per_gb("azure", "eastus", "azure", "westeurope") == 0.05
    assert egress_usd_per_gb("gcp", "us-central1-a", "gcp", "us-central1-b") == 0.0


def test_egress_between_regions_of_a_cloud_without_a_reference_region_needs_both():
    with pytest.raises(LookupError, match="needs both regions"):
        egress_usd_per_gb("aws", None, "aws", "us-east-1")
    assert egress_usd_per_gb("aws", None, "gcp", None) == egress_usd_per_gb("aws", "us-east-1", "gcp", None)
