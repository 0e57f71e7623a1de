"""Tests for infra/policies: hand-built snapshots with expected decisions, and randomized
invariants with fixed seeds. Pure: no I/O, fake clock values."""

from __future__ import annotations

import json
import random

import pytest

from infra.rollout.controller_config import ControllerConfig, OffloadSettings
from infra.rollout.policies import (
    CapacityConfig,
    CapacityTarget,
    ClusterSnapshot,
    InstanceView,
    OffloadController,
    PoolOffer,
    QueueView,
    ReaperConfig,
    RunningSample,
    StealConfig,
    StepTiming,
    StepView,
    active,
    claim_key,
    claim_score,
    effective_throughput,
    eligible,
    plan_capacity,
    reap,
    steal,
)
from infra.sim.claiming import DispatchDecision, dispatch

NOW = 100.0


def inst(
    iid: str,
    *,
    cls: str = "spot",
    version: int | None = 1,
    slots: int = 4,
    running: int = 0,
    remaining: int = 512,
    hb: float = NOW,
    alive: bool = True,
    draining: bool = False,
    asked_at: float | None = None,
) -> InstanceView:
    samples = tuple(RunningSample(f"{iid}-{k}", 0, remaining) for k in range(running))
    return InstanceView(iid, "pool", cls, version, slots, samples, hb, alive, draining, 1.0, asked_at)


def snap(*instances: InstanceView, queued: int = 0, now: float = NOW, version: int = 1) -> ClusterSnapshot:
    step = StepView(
        step=3, policy_version=version, started_at=0.0, total_samples=64, done=0, groups_total=8, groups_done=0
    )
    return ClusterSnapshot(now, step, tuple(instances), QueueView(queued))


def counts(decisions) -> dict[str, int]:
    return {d.instance_id: d.count for d in decisions}


# --- snapshot -------------------------------------------------------------------------------


def test_snapshot_helpers():
    sample = RunningSample("s", tokens_generated=300, budget=256)
    assert sample.remaining == 0
    busy = inst("a", slots=2, running=3)
    assert busy.free_slots == 0
    s = snap(
        inst("r", cls="reserved"),
        inst("s"),
        inst("o", cls="ondemand"),
        inst("d", draining=True),
        inst("x", alive=False),
    )
    assert s.rollout_only_alive == 2
    assert not s.can_generate(inst("v", version=2)) and not s.can_generate(inst("n", version=None))


# --- claims: the token log's order; the simulator's dispatch (infra.sim.claiming) -----------


def test_claim_score_is_the_lua_score_more_logged_tokens_first_then_fifo():
    samples = [(5, 0), (9, 10), (1, 0), (2, 3), (7, 3), (3, 10)]  # (enqueue seq, logged tokens)
    order = sorted(samples, key=lambda t: claim_score(*t))
    assert order == [(3, 10), (9, 10), (2, 3), (7, 3), (1, 0), (5, 0)]
    assert claim_score(7, 3) == 7 - 3 * 4294967296  # tokenlog.py's Lua: seq - ntok * 4294967296
    # the extremes stay exact in a float64 (a Redis sorted set's score) and keep the order
    low, high = claim_score(2**32 - 1, 2**21 - 1), claim_score(0, 2**21 - 1)
    assert float(low) == low and float(high) == high and high < low < claim_score(0, 2**21 - 2)


@pytest.mark.parametrize(("seq", "tokens"), [(-1, 0), (2**32, 0), (0, -1), (0, 2**21)])
def test_claim_score_rejects_what_the_lua_score_cannot_order(seq, tokens):
    with pytest.raises(ValueError):
        claim_score(seq, tokens)


def test_claim_key_oldest_step_then_routed_then_score():
    keys = {
        "step1 partial": claim_key(1, False, 1, 50),
        "step0 fresh": claim_key(0, False, 1, 0),
        "step0 partial": claim_key(0, False, 9, 5),
        "step0 routed fresh": claim_key(0, True, 12, 0),
    }
    assert sorted(keys, key=keys.__getitem__) == ["step0 routed fresh", "step0 partial", "step0 fresh", "step1 partial"]
    with pytest.raises(ValueError):
        claim_key(-1, False, 1, 0)


def test_dispatch_nothing_without_instances_or_with_all_dead():
    assert dispatch(snap(queued=10), reserved_released=False) == ()
    dead = snap(inst("a", alive=False), inst("b", alive=False, cls="reserved"), queued=10)
    assert dispatch(dead, reserved_released=False) == ()


def test_dispatch_caps_at_free_slots_and_queue():
    s = snap(inst("a", running=1), inst("b", running=3), queued=10)
    assert dispatch(s, reserved_released=False) == (DispatchDecision("a", 3), DispatchDecision("b", 1))
    assert counts(dispatch(snap(inst("a", running=1), inst("b", running=3), queued=2), reserved_released=False)) == {
        "a": 2
    }
    assert counts(dispatch(snap(inst("a", running=1), inst("b", running=3), queued=4), reserved_released=False)) == {
        "a": 3,
        "b": 1,
    }
    assert dispatch(snap(inst("a"), queued=0), reserved_released=False) == ()


def test_dispatch_serves_spot_before_reserved():
    s = snap(inst("r", cls="reserved"), inst("s", slots=2), queued=3)
    assert counts(dispatch(s, reserved_released=False)) == {"r": 1, "s": 2}


def test_dispatch_skips_wrong_version_draining_and_dead():
    s = snap(
        inst("v2", version=2),
        inst("none", version=None),
        inst("drain", draining=True),
        inst("dead", alive=False),
        inst("ok"),
        queued=20,
    )
    assert counts(dispatch(s, reserved_released=False)) == {"ok": 4}


def test_dispatch_after_t_local_gives_reserved_nothing():
    s = snap(inst("r", cls="reserved"), inst("s"), inst("o", cls="ondemand"), queued=20)
    assert counts(dispatch(s, reserved_released=True)) == {"s": 4, "o": 4}
    assert not eligible(s, s.instances[0], reserved_released=True) and not active(
        s, s.instances[0], reserved_released=True
    )


def test_zero_spot_reserved_never_release_and_keep_getting_work():
    controller = offload(10.0)
    for now in (0.0, 10.0, 1e6):
        s = snap(
            inst("r1", cls="reserved"),
            inst("r2", cls="reserved", running=2),
            inst("gone", alive=False),
            queued=5,
            now=now,
        )
        released = controller.should_release(now, s.step.started_at, s.rollout_only_alive)
        assert released is False
        assert counts(dispatch(s, reserved_released=released)) == {"r1": 4, "r2": 1}  # 4 and 3 running


# --- steal ----------------------------------------------------------------------------------


def test_steal_balances_and_takes_most_remaining_first():
    running = tuple(RunningSample(f"s{k}", 0, 100 * (k + 2)) for k in range(6))
    busy = InstanceView("a", "pool", "spot", 1, 8, running, NOW)
    decisions = steal(snap(busy, inst("b", slots=8)), StealConfig(min_remaining_tokens=1), reserved_released=False)
    assert len(decisions) == 1 and (decisions[0].from_instance, decisions[0].to_instance) == ("a", "b")
    assert decisions[0].sample_ids == ("s5", "s4", "s3") and decisions[0].count == 3  # 6/0 -> 3/3


def test_steal_never_with_a_queue():
    s = snap(inst("a", slots=8, running=8), inst("b", slots=8), queued=1)
    assert steal(s, StealConfig(), reserved_released=False) == ()


def test_steal_respects_min_keep_and_idle_capacity():
    s = snap(inst("a", slots=8, running=4), inst("b", slots=8))
    assert [d.count for d in steal(s, StealConfig(min_keep=3), reserved_released=False)] == [1]
    s = snap(inst("a", slots=8, running=8), inst("b", slots=4, running=3))
    assert [d.count for d in steal(s, StealConfig(), reserved_released=False)] == [1]


def test_steal_cooldown():
    config = StealConfig(cooldown_s=5.0)
    recent = snap(inst("a", slots=8, running=8, asked_at=NOW - 2), inst("b", slots=8))
    assert steal(recent, config, reserved_released=False) == ()
    old = snap(inst("a", slots=8, running=8, asked_at=NOW - 6), inst("b", slots=8))
    assert [d.count for d in steal(old, config, reserved_released=False)] == [4]


def test_steal_skips_samples_about_to_finish():
    s = snap(inst("a", slots=8, running=8, remaining=50), inst("b", slots=8))
    assert steal(s, StealConfig(min_remaining_tokens=128), reserved_released=False) == ()


def test_steal_config_validation():
    with pytest.raises(ValueError):
        StealConfig(min_gap=0)


def test_steal_needs_an_eligible_receiver_and_a_real_gap():
    config = StealConfig()
    assert (
        steal(snap(inst("a", slots=8, running=8), inst("b", slots=8, version=2)), config, reserved_released=False) == ()
    )
    assert (
        steal(snap(inst("a", slots=8, running=8), inst("r", cls="reserved", slots=8)), config, reserved_released=True)
        == ()
    )
    assert (
        steal(snap(inst("a", slots=8, running=3), inst("b", slots=8, running=2)), config, reserved_released=False) == ()
    )
    assert steal(snap(), config, reserved_released=False) == ()


def test_steal_spreads_over_receivers_and_no_instance_is_both_sides():
    s = snap(inst("a", slots=8, running=8), inst("b", slots=8), inst("c", slots=8), inst("m", slots=8, running=5))
    decisions = steal(s, StealConfig(), reserved_released=False)
    # a 8, m 5, b 0, c 0: the most loaded gives to the least loaded until loads are a3 m4 b3 c3;
    # m stops being a receiver once it gives. Each decision names the receiver it was computed for.
    assert {(d.from_instance, d.to_instance): d.count for d in decisions} == {
        ("a", "b"): 2,
        ("a", "c"): 3,
        ("m", "b"): 1,
    }
    assert len({s for d in decisions for s in d.sample_ids}) == 6


def test_steal_routes_to_the_least_loaded_receiver_not_the_roomiest():
    # b runs nothing in 1 slot, c runs 1 of 8: the first sample is b's (the least loaded) even
    # though c has more free slots, which the shared queue would have let c claim as well.
    s = snap(inst("a", slots=8, running=4), inst("b", slots=1), inst("c", slots=8, running=1))
    decisions = steal(s, StealConfig(), reserved_released=False)
    assert [(d.from_instance, d.to_instance, d.count) for d in decisions] == [("a", "b", 1), ("a", "c", 1)]


# --- reaper ---------------------------------------------------------------------------------


def test_reaper():
    config = ReaperConfig(timeout_s=ControllerConfig().reap_timeout_s)
    assert reap(snap(), config) == ()
    s = snap(inst("late", hb=NOW - 45), inst("edge", hb=NOW - 30), inst("fresh"), inst("dead", hb=0.0, alive=False))
    decisions = reap(s, config)
    assert [d.instance_id for d in decisions] == ["late"]
    assert decisions[0].reason == "no heartbeat for 45.0 s (timeout 30.0 s)"
    assert reap(snap(inst("a", hb=0.0, alive=False), inst("b", hb=0.0, alive=False)), config) == ()


# --- offload --------------------------------------------------------------------------------


def offload(initial_t_local_s: float, **settings: float) -> OffloadController:
    """The controller of the `controller.offload` settings: their defaults, but the ones given."""
    return OffloadSettings(initial_t_local_s=initial_t_local_s, **settings).new_controller()


def timing(t: float, *, ti: float = 0.0, ri: float = 0.0, thr: float = 100.0, n: int = 4) -> StepTiming:
    return StepTiming(t_local_s=t, trainer_idle_s=ti, rollout_idle_s=ri, throughput=thr, num_spot=n)


def test_t_local_update_math_and_clamps():
    c = offload(10.0, floor_s=5.0, ceiling_s=13.0)
    assert c.update(timing(c.t_local(4), ti=6.0)) == 12.0
    assert c.update(timing(c.t_local(4), ti=6.0, thr=101)) == 13.0  # 14 clamped to the ceiling
    c = offload(6.0, floor_s=5.0)
    assert c.update(timing(6.0, ri=9.0)) == 5.0  # 6 - 3 clamped to the floor
    c = offload(12.0, damping=3.0)
    assert c.update(timing(12.0, ti=1.0, ri=10.0)) == 9.0


def test_hill_climb_reverts_a_bad_move_and_halves_later_moves():
    c = offload(10.0)
    assert c.update(timing(10.0, ti=6.0, thr=100)) == 12.0
    assert c.update(timing(12.0, ti=6.0, thr=90)) == 10.0  # throughput fell: back to the best
    assert c.update(timing(10.0, ti=6.0, thr=95)) == 11.0  # best re-measured; move halved: +1
    assert c.update(timing(11.0, ti=6.0, thr=97)) == 13.0  # improved: new best, full move again


def test_best_t_local_remembered_per_spot_count():
    c = offload(10.0)
    c.update(timing(c.t_local(4), ti=6.0, n=4))  # best for 4 spot: 10; current 12
    assert c.t_local(4) == 12.0 and c.t_local(8) == 12.0  # same count / unknown count: current
    assert c.update(timing(c.t_local(8), ri=9.0, thr=150, n=8)) == 9.0
    assert c.t_local(4) == 10.0  # the fleet went back to 4: start from its best
    assert c.t_local(8) == 9.0


def test_should_release_and_zero_spot_steps_teach_nothing():
    c = offload(10.0)
    assert not c.should_release(109.9, 100.0, 3)
    assert c.should_release(110.0, 100.0, 3)
    assert not c.should_release(1e9, 100.0, 0)
    before = c.to_dict()
    assert c.update(timing(10.0, ti=50.0, n=0)) == 10.0 and c.to_dict() == before


def test_offload_state_round_trips_through_json():
    c = offload(10.0, floor_s=2.0, ceiling_s=40.0)
    c.update(timing(10.0, ti=6.0, n=4))
    c.update(timing(12.0, ti=6.0, thr=90, n=4))
    c.update(timing(c.t_local(2), ri=3.0, n=2))
    resumed = OffloadController.from_dict(json.loads(json.dumps(c.to_dict())))
    assert resumed.to_dict() == c.to_dict()
    for n in (0, 2, 4, 7):
        assert resumed.t_local(n) == c.t_local(n)
    step = timing(c.t_local(4), ti=3.0, thr=99, n=4)
    assert resumed.update(step) == c.update(step)


def test_offload_rejects_bad_parameters():
    with pytest.raises(ValueError):
        offload(1.0, floor_s=5.0)
    with pytest.raises(ValueError):
        offload(10.0, ceiling_s=5.0)
    with pytest.raises(ValueError):
        OffloadController(10.0, 0.0, None, damping=0.0)
    with pytest.raises(ValueError):
        timing(10.0, ti=-1.0)


# --- capacity -------------------------------------------------------------------------------


def test_capacity_ranks_by_price_per_effective_throughput():
    offers = (PoolOffer("a", 1.0, 1.0, max_instances=10), PoolOffer("b", 1.5, 2.0, max_instances=10))
    assert plan_capacity(offers, CapacityConfig(budget_per_hour=4.5)) == (
        CapacityTarget("a", 0),
        CapacityTarget("b", 3),
    )
    churny = PoolOffer("c", 1.0, 100.0, max_instances=1, preemptions_per_hour=6.0)
    assert effective_throughput(churny, CapacityConfig(budget_per_hour=1.0, warmup_s=600.0)) == 50.0


def test_capacity_respects_price_cap_budget_max_and_availability():
    config = CapacityConfig(budget_per_hour=10.0)
    over_cap = PoolOffer("cap", 2.0, 1.0, max_instances=5, min_instances=2, price_cap=1.5)
    scarce = PoolOffer("scarce", 0.1, 1.0, max_instances=5, availability=0.1)
    capped = PoolOffer("max", 1.0, 1.0, max_instances=2)
    budgeted = PoolOffer("budget", 3.0, 1.0, max_instances=100)
    targets = plan_capacity((over_cap, scarce, capped, budgeted), config)
    assert targets == (
        CapacityTarget("cap", 0),
        CapacityTarget("scarce", 0),
        CapacityTarget("max", 2),
        CapacityTarget("budget", 2),  # 10 - 2 = 8 left: two at 3.0
    )
    assert plan_capacity((), config) == ()


def test_capacity_minimums_first_then_cheapest_fill_and_leftover_budget():
    best = PoolOffer("best", 1.0, 10.0, max_instances=10)
    floor = PoolOffer("floor", 1.0, 1.0, max_instances=10, min_instances=2)
    assert plan_capacity((best, floor), CapacityConfig(budget_per_hour=5.0)) == (
        CapacityTarget("best", 3),
        CapacityTarget("floor", 2),
    )
    pricey = PoolOffer("pricey", 4.0, 10.0, max_instances=10)
    cheap = PoolOffer("cheap", 1.0, 1.0, max_instances=10)
    assert plan_capacity((pricey, cheap), CapacityConfig(budget_per_hour=6.0)) == (
        CapacityTarget("pricey", 1),
        CapacityTarget("cheap", 2),
    )
    free = PoolOffer("free", 0.0, 1.0, max_instances=7)
    assert plan_capacity((free,), CapacityConfig(budget_per_hour=0.0)) == (CapacityTarget("free", 7),)
    assert plan_capacity((free, cheap), CapacityConfig(budget_per_hour=100.0, max_total=9)) == (
        CapacityTarget("free", 7),
        CapacityTarget("cheap", 2),
    )


def test_capacity_tie_breaks_on_availability_then_name():
    offers = (
        PoolOffer("z", 1.0, 1.0, max_instances=5),
        PoolOffer("y", 1.0, 1.0, max_instances=5, availability=0.9),
        PoolOffer("x", 1.0, 1.0, max_instances=5),
    )
    assert plan_capacity(offers, CapacityConfig(budget_per_hour=7.0)) == (
        CapacityTarget("z", 2),
        CapacityTarget("y", 0),
        CapacityTarget("x", 5),
    )
    with pytest.raises(ValueError):
        PoolOffer("bad", 1.0, 1.0, max_instances=1, min_instances=2)


# --- randomized invariants ------------------------------------------------------------------


def random_snapshot(rng: random.Random) -> ClusterSnapshot:
    instances = []
    for k in range(rng.randint(0, 8)):
        slots = rng.randint(1, 8)
        running = tuple(
            RunningSample(f"i{k}-{j}", rng.randint(0, 300), rng.choice([64, 256, 512]))
            for j in range(rng.randint(0, slots))
        )
        instances.append(
            InstanceView(
                f"i{k}",
                rng.choice(["p1", "p2"]),
                rng.choice(["reserved", "ondemand", "spot"]),
                rng.choice([None, 1, 1, 1, 2]),
                slots,
                running,
                NOW - rng.uniform(0, 60),
                rng.random() > 0.15,
                rng.random() < 0.15,
                rng.uniform(0, 3),
                rng.choice([None, NOW - rng.uniform(0, 20)]),
            )
        )
    return snap(*instances, queued=rng.choice([0, 0, rng.randint(0, 40)]))


@pytest.mark.parametrize("seed", range(300))
def test_random_snapshots_keep_the_invariants(seed):
    rng = random.Random(seed)
    s = random_snapshot(rng)
    released = rng.random() < 0.5
    by_id = {i.instance_id: i for i in s.instances}

    decisions = dispatch(s, reserved_released=released)
    assert sum(d.count for d in decisions) <= s.queue.queued
    for d in decisions:
        assert 0 < d.count <= by_id[d.instance_id].free_slots
        assert eligible(s, by_id[d.instance_id], reserved_released=released)
    if s.queue.queued:
        given = sum(d.count for d in decisions)
        capacity = sum(i.free_slots for i in s.instances if eligible(s, i, reserved_released=released))
        assert given == min(s.queue.queued, capacity)

    config = StealConfig(min_keep=rng.randint(0, 3), min_remaining_tokens=rng.choice([1, 100, 300]), cooldown_s=5.0)
    stolen = steal(s, config, reserved_released=released)
    if s.queue.queued:
        assert stolen == ()
    idle = sum(i.free_slots for i in s.instances if eligible(s, i, reserved_released=released))
    assert sum(d.count for d in stolen) <= idle
    given = {v: sum(d.count for d in stolen if d.from_instance == v) for v in {d.from_instance for d in stolen}}
    received = {r: sum(d.count for d in stolen if d.to_instance == r) for r in {d.to_instance for d in stolen}}
    assert not set(given) & set(received), "no instance is both victim and receiver"
    for r, count in received.items():
        assert count <= by_id[r].free_slots and eligible(s, by_id[r], reserved_released=released)
    for d in stolen:
        victim = by_id[d.from_instance]
        assert d.count > 0 and len(victim.running) - given[d.from_instance] >= config.min_keep
        assert victim.steal_requested_at is None or NOW - victim.steal_requested_at >= config.cooldown_s
        remaining = {r.sample_id: r.remaining for r in victim.running}
        assert len(set(d.sample_ids)) == d.count and all(
            remaining[i] >= config.min_remaining_tokens for i in d.sample_ids
        )
