"""The `paper` variant's offload rule behaves as the RLBoost artifact's rollout manager does
(rollout-manager/src/balance.rs: a third of the bubble difference in whole seconds, a 5 s floor,
budgets remembered per spot count), and the simulator holds the reserved cluster to its fixed
budget."""

from __future__ import annotations

import pytest

from infra.rollout.policies import StepTiming
from infra.sim.artifact_offload import ArtifactOffload
from infra.sim.scenario import PaperOffloadSection
from tests.infra.sim.test_simulator import run, small

PAPER = PaperOffloadSection(initial_s=150, budgets_s={1: 190, 2: 160, 3: 105, 4: 70}, floor_s=5)


def timing(count: int, trainer_idle: float = 0.0, rollout_idle: float = 0.0, throughput: float = 1000.0):
    return StepTiming(
        t_local_s=0.0, trainer_idle_s=trainer_idle, rollout_idle_s=rollout_idle, throughput=throughput, num_spot=count
    )


def test_a_new_spot_count_jumps_to_its_budget_and_a_steady_one_follows_a_third_of_the_bubbles():
    offload = ArtifactOffload(PAPER)
    assert offload.t_local(1) == 150  # the first step runs the initial budget
    assert offload.update(timing(1, rollout_idle=40)) == 190  # count 0 -> 1: the profiled budget
    # rollout side waited 40.9 s, the trainer 10.2 s: down by (40 - 10) // 3 = 10
    assert offload.update(timing(1, trainer_idle=10.2, rollout_idle=40.9, throughput=1100)) == 180
    # the trainer waited longer: up by (31 - 1) // 3 = 10
    assert offload.update(timing(1, trainer_idle=31, rollout_idle=1, throughput=1200)) == 190
    assert offload.update(timing(1, rollout_idle=1000, throughput=1300)) == 5  # never below the floor


def test_budgets_are_remembered_per_count_and_the_peak_is_folded_in():
    offload = ArtifactOffload(PAPER)
    offload.update(timing(2))  # -> 160
    offload.update(timing(2, rollout_idle=30, throughput=1000))  # throughput grew: peak 160, -> 150
    offload.update(timing(2, rollout_idle=30, throughput=900))  # it fell: fold the peak (160) in, -> 140
    assert offload.best[2] == 160
    assert offload.update(timing(3)) == 105  # count 2 -> 3: jump; 2's memory folds its peak at 0.2
    assert offload.best[2] == 160
    offload.update(timing(3, rollout_idle=60, throughput=1000))  # peak 105, -> 85
    assert offload.update(timing(2)) == 160
    assert offload.best[3] == round(0.8 * 105 + 0.2 * 105)


def test_an_unknown_count_follows_the_rule_and_a_step_without_spot_teaches_nothing():
    offload = ArtifactOffload(PAPER)
    assert offload.update(timing(6, rollout_idle=33)) == 139  # no budget for 6: the rule, from 150
    assert offload.update(timing(0, rollout_idle=99)) == 139
    assert not offload.should_release(1000.0, 0.0, 0)  # nothing to hand off to
    assert offload.should_release(139.0, 0.0, 6) and not offload.should_release(138.9, 0.0, 6)


def test_the_paper_variant_trains_only_once_its_fixed_budget_is_over():
    # instances always there, a budget far longer than the rollout: the reserved cluster sits
    # out the budget (the artifact sleeps it), where this project's trains once the rollout is done
    sections = {
        "availability": {"source": "constant"},
        "run": {"max_steps": 3, "duration_s": 10_000},
        "paper_offload": {"initial_s": 400, "budgets_s": {3: 400}},
    }
    paper = run(small(**sections), "paper")
    ours = run(small(**sections, controller={"offload": {"initial_t_local_s": 400}}), "rlboost_no_steal")
    assert paper.steps[0].t_local_s == 400
    for step in paper.steps:  # the rule then shortens the budget (the rollout side waited)
        assert step.rollout_s < step.t_local_s <= step.ended_at - step.started_at
    assert paper.steps[1].t_local_s == 400 > paper.steps[2].t_local_s  # the jump to its budget for 3, then the rule
    assert all(step.ended_at - step.started_at < 400 for step in ours.steps)
    # the same groups, trained by the artifact's veRL with its old-log-prob forward (8 FLOPs per
    # parameter per token) and by this project's trainer without it (6)
    assert paper.steps[0].train_s * 6 / 8 == pytest.approx(ours.steps[0].train_s)
