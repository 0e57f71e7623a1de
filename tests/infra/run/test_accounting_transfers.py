"""The weight pulls of a step reach its row: each pull reported by an instance (through real
Redis) is recorded in the ledger with the step and its seconds, and `end_step` returns the bytes
received, the whole-version fallbacks (counted once per pull however many sources it used), the
number of pulls and the slowest one's seconds."""

from __future__ import annotations

import pytest

from infra.ledger.recorder import Ledger
from infra.providers.interface import InstanceRecord
from infra.run.accounting import RunAccounting, WeightTraffic
from infra.weights.puller import PullReport
from infra.weights.shared import drain_transfers, report_transfer
from tests.helpers import Clock, RecordedInstances

pytestmark = pytest.mark.integration


def test_a_steps_pulls_are_summed_with_their_fallbacks_and_their_slowest_time(redis_client, tmp_path):
    clock = Clock()
    spot = InstanceRecord("spot-0", "spot", "spot", "a2-highgpu-1g", 1.0, clock())
    other = InstanceRecord("spot-1", "spot", "spot", "a2-highgpu-1g", 1.0, clock())
    report = PullReport(version=3, instance_id="spot-0", seconds=0.75, bytes=1500, full_fallbacks=1)
    report.bytes_by_source = {"store": 1000, "http://peer": 500}
    report_transfer(redis_client, "run-1", report)
    report_transfer(
        redis_client, "run-1", PullReport(version=3, instance_id="spot-1", seconds=0.25, bytes_by_source={"store": 20})
    )
    report_transfer(
        redis_client, "run-1", PullReport(version=3, instance_id="gone-0", seconds=9.0, bytes_by_source={"store": 7})
    )
    with Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        accounting = RunAccounting(
            ledger,
            "run-1",
            "run",
            (),
            RecordedInstances(spot, other),
            transfers=lambda: drain_transfers(redis_client, "run-1"),
            clock=clock,
            heartbeat_s=60,
        )
        accounting.begin_step(3)
        clock.advance(10)
        traffic = accounting.end_step(3, tokens_trained=100)
        accounting.finish()
        # gone-0 is no instance of this run: neither its bytes nor its 9 s count
        assert traffic == WeightTraffic(nbytes=1520, full_fallbacks=1, pulls=2, pull_s=0.75)
        (step,) = ledger.report("run-1").steps
        assert (step.transfer_bytes, step.pulls, step.pull_s_max) == (1520, 2, 0.75)


def test_a_step_without_pulls_has_no_pull_time(tmp_path):
    clock = Clock()
    with Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        accounting = RunAccounting(ledger, "run-1", "run", (), None, transfers=list, clock=clock, heartbeat_s=60)
        accounting.begin_step(1)
        traffic = accounting.end_step(1, tokens_trained=100)
        accounting.finish()
    assert traffic == WeightTraffic() and traffic.pull_s is None and traffic.pulls == 0
