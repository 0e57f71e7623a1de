"""The run summary (`infra.run.summary.summarize`) on hand-made step records: accuracy gain, final
reward, tokens, the staleness figures weighted by each step's tokens, the run's facts, and the cost
lines from a microdollar up."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from infra.run.step_record import History, StepRecord
from infra.run.summary import RunFacts, summarize

COSTS = {  # a `CostReport.summary()`, the lines this test needs
    "total_usd": 1.0,
    "attributed_usd": 0.7,
    "unattributed_usd": 0.3,
    "unattributed_before_step_1_usd": 0.3,
    "unattributed_between_steps_usd": 4e-7,  # the database's timestamp rounding: left out
    "spend_spot_usd": 0.2,
    "spend_reserved_usd": 0.8,
    "trainer_usd": 0.5,
    "trainer_recorded": True,
    "usd_per_million_generated": None,  # not known: left out
    "preemptions": 2,
}

FACTS = RunFacts(
    name="summary-test",
    steps=2,
    max_staleness=1,
    minutes=1.5,
    curves_png=Path("runs/summary-test/curves.png"),
    checkpoint=Path("runs/summary-test/checkpoints"),
    ledger_run_id="run-1",
)


def _history() -> History:
    return History(
        [
            StepRecord(step=1, reward=0.2, tokens=100),  # a step without staleness: lag 0, weight 1, no gap
            StepRecord(
                step=2,
                reward=0.6,
                tokens=300,
                version_lag_mean=1.0,
                version_lag_max=1,
                is_weight_mean=0.9,
                is_truncated_fraction=0.1,
                logprob_gap=0.02,
            ),
        ],
        [(0, 0.25), (2, 0.5)],
    )


def test_the_summary_of_two_hand_made_steps():
    summary = summarize(_history(), COSTS, FACTS)
    assert list(summary)[:7] == [
        "run",
        "steps",
        "base_accuracy",
        "final_accuracy",
        "gain_points",
        "final_reward",
        "tokens_generated",
    ]
    assert (summary["run"], summary["steps"], summary["tokens_generated"]) == ("summary-test", 2, 400)
    assert (summary["base_accuracy"], summary["final_accuracy"]) == (0.25, 0.5)
    assert summary["gain_points"] == pytest.approx(25.0) and summary["final_reward"] == pytest.approx(0.4)
    assert (summary["max_staleness"], summary["version_lag_max"]) == (1, 1)
    assert summary["version_lag_mean"] == pytest.approx(0.75)  # 300 of 400 tokens one version behind
    assert summary["is_weight_mean"] == pytest.approx((100 * 1.0 + 300 * 0.9) / 400)
    assert summary["is_truncated_fraction"] == pytest.approx(0.075)
    assert summary["logprob_gap_mean"] == pytest.approx(0.015)
    assert summary["curves_png"] == str(FACTS.curves_png) and summary["ledger_run_id"] == "run-1"
    assert "adapter_mib_per_version" not in summary and "vs_baseline" not in summary
    costs = {key: value for key, value in summary.items() if key.endswith("_usd") or key == "preemptions"}
    assert costs == {
        "total_usd": 1.0,
        "attributed_usd": 0.7,
        "unattributed_before_step_1_usd": 0.3,
        "spend_spot_usd": 0.2,
        "spend_reserved_usd": 0.8,
        "trainer_usd": 0.5,
        "preemptions": 2,
    }


def test_the_final_reward_is_the_last_ten_steps_and_the_facts_add_their_lines():
    history = History([StepRecord(step=s, reward=s / 10, tokens=10) for s in range(1, 13)], [(0, 0.1), (12, 0.4)])
    facts = replace(FACTS, adapter_mib=0.625, baseline={"vs_baseline": "base-1"})
    summary = summarize(history, {**COSTS, "trainer_recorded": False}, facts)
    assert summary["final_reward"] == pytest.approx(sum(range(3, 13)) / 100)
    assert summary["adapter_mib_per_version"] == 0.625 and summary["vs_baseline"] == "base-1"
    assert summary["trainer_usd"].startswith("not recorded: set ledger.trainer")
    assert list(summary)[-2:] == ["vs_baseline", "ledger_run_id"]


def test_infrastructure_failures_are_summed_by_kind_over_the_run():
    steps = [
        StepRecord(step=1, reward=0.5, tokens=10, infra_failed={}),
        StepRecord(step=2, reward=0.5, tokens=10, infra_failed={"env_timeout": 2, "env_error": 1}),
        StepRecord(step=3, reward=0.5, tokens=10, infra_failed={"env_error": 3}),
    ]
    summary = summarize(History(steps, [(0, 0.1), (3, 0.2)]), COSTS, FACTS)
    assert (summary["infra_failed"], summary["infra_failed_env_error"], summary["infra_failed_env_timeout"]) == (
        6,
        4,
        2,
    )
    assert "infra_failed" not in summarize(_history(), COSTS, FACTS)  # no fabric: nothing counted
