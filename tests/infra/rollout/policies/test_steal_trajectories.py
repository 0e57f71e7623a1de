"""The steal policy on trajectories (issue 37 item 6): a trajectory waiting for its environment is
never taken and does not count as load, and one with more turns left goes first. Pure: hand-built
snapshots, fake clock values."""

from __future__ import annotations

from infra.rollout.policies import ClusterSnapshot, InstanceView, QueueView, RunningSample, StealConfig, StepView, steal

NOW = 100.0
CONFIG = StealConfig(min_keep=1, min_gap=2, min_remaining_tokens=64)


def instance(iid: str, samples: tuple[RunningSample, ...], slots: int = 8) -> InstanceView:
    return InstanceView(iid, "pool", "spot", 1, slots, samples, NOW)


def snapshot(*instances: InstanceView) -> ClusterSnapshot:
    step = StepView(step=3, policy_version=1, started_at=0.0, total_samples=64, done=0, groups_total=8, groups_done=0)
    return ClusterSnapshot(NOW, step, instances, QueueView(0))


def trajectory(sid: str, turns: int = 0, awaiting: bool = False, generated: int = 0) -> RunningSample:
    return RunningSample(sid, generated, 400, turns=turns, max_turns=4, awaiting_env=awaiting)


def test_turns_left_counts_the_current_turn_and_a_single_turn_sample_has_one() -> None:
    assert RunningSample("s", 10, 100).turns_left == 1
    assert trajectory("t", turns=1).turns_left == 3 and trajectory("t", turns=9).turns_left == 1


def test_a_trajectory_waiting_for_its_environment_is_never_stolen_nor_counted_as_load() -> None:
    waiting = tuple(trajectory(f"w{k}", turns=1, awaiting=True) for k in range(5))
    busy = instance("a", (*waiting, trajectory("d0"), trajectory("d1")))
    idle = instance("b", ())
    assert busy.decoding == 2 and busy.free_slots == 1
    # Two decoding samples against none: a gap of 2, so one moves, and never a waiting one.
    (decision,) = steal(snapshot(busy, idle), CONFIG, reserved_released=True)
    assert decision.from_instance == "a" and decision.to_instance == "b"
    assert decision.sample_ids in (("d0",), ("d1",))
    # Only waiting trajectories and one decoding sample: nothing to balance.
    calm = instance("a", (*waiting, trajectory("d0")))
    assert steal(snapshot(calm, idle), CONFIG, reserved_released=True) == ()


def test_the_trajectory_with_the_most_turns_left_goes_first_then_the_most_budget() -> None:
    samples = (
        trajectory("late", turns=3, generated=0),  # 1 turn left, the most budget left
        trajectory("early", turns=0, generated=200),  # 4 turns left
        trajectory("middle", turns=1, generated=100),  # 3 turns left
        trajectory("keep", turns=3, generated=300),
        trajectory("keep2", turns=3, generated=300),
    )
    decisions = steal(snapshot(instance("a", samples), instance("b", ())), CONFIG, reserved_released=True)
    assert [d.sample_ids for d in decisions] == [("early", "middle")]


def test_single_turn_samples_are_ordered_by_remaining_budget_as_before() -> None:
    samples = tuple(RunningSample(f"s{k}", 0, 100 * (k + 2)) for k in range(4))
    (decision,) = steal(snapshot(instance("a", samples), instance("b", ())), CONFIG, reserved_released=True)
    assert decision.sample_ids == ("s3", "s2")  # 4 against 0, then 3 against 1
