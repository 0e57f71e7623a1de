"""The run summary's cost figures (`infra.run.summary.cost_summary`) from real ledger reports."""

from __future__ import annotations

import pytest

from infra.ledger.recorder import Ledger
from infra.run.summary import cost_summary
from tests.infra.ledger.test_ledger_comparison import record_baseline, record_hybrid


@pytest.fixture
def ledger(tmp_path):
    with Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as opened:
        record_baseline(opened)
        record_hybrid(opened, "no-trainer", trainer=False)
        yield opened


def test_the_summary_carries_the_trainers_cost_or_says_it_was_not_recorded(ledger):
    recorded = cost_summary(ledger.report("base-1").summary())
    assert recorded["trainer_usd"] == pytest.approx(3.67) == recorded["total_usd"]
    assert recorded["trained_tokens_per_s"] == pytest.approx(6000 / 3600)
    missing = cost_summary(ledger.report("no-trainer").summary())
    assert missing["trainer_usd"].startswith("not recorded: set ledger.trainer")
    assert not {key for key in recorded | missing if "savings" in key or "ondemand_only" in key}
