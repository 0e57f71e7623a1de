"""A re-run's accounting records only its own attempt: a weight pull reported (in Redis) by an
instance of the dead attempt, which the ledger may never have seen, is not recorded; and the
driver's heartbeats keep the run's `heartbeat_at` current."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from infra.ledger.models import Run, WeightTransfer
from infra.ledger.recorder import Ledger
from infra.run.accounting import RunAccounting
from infra.weights.shared import Transfer
from tests.helpers import Clock, wait_for


def test_a_pull_by_a_dead_attempts_instance_is_not_recorded(tmp_path):
    clock = Clock()
    with Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        reported = [Transfer("a2-spot-0", 3, "store", 1000, 0.5)]  # attempt 2 died before recording it
        accounting = RunAccounting(
            ledger, "run-1", "run", (), None, transfers=lambda: reported, clock=clock, heartbeat_s=0.01
        )
        accounting.begin_step(4)
        clock.advance(10)
        accounting.end_step(4, tokens_trained=100)
        wait_for(lambda: ledger.report("run-1").as_of.timestamp() == clock(), "a heartbeat at the clock's time")
        accounting.finish()
        with Session(ledger.engine) as session:
            assert session.scalars(select(WeightTransfer)).all() == []
            assert session.get(Run, "run-1").heartbeat_at.timestamp() == clock()
