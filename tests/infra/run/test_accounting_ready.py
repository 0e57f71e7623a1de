"""Each instance's ready time reaches the ledger: the accounting records when its worker first
registered in the real registry (Redis), and a later registration (a restarted worker) never
moves it; the cost report turns it into the instance's boot seconds."""

from __future__ import annotations

import time

import pytest

from infra.ledger.recorder import Ledger
from infra.providers.interface import InstanceRecord
from infra.rollout.instance import InstanceSpec
from infra.rollout.registry import InstanceRegistry
from infra.run.accounting import RunAccounting
from tests.helpers import RecordedInstances

pytestmark = pytest.mark.integration


def test_the_first_registration_is_the_ready_time_and_stays(redis_client, tmp_path):
    registry = InstanceRegistry(redis_client, "run-1")
    launched = time.time() - 30
    booted = InstanceRecord("spot-0", "spot", "spot", "a2-highgpu-1g", 1.0, launched)
    booting = InstanceRecord("spot-1", "spot", "spot", "a2-highgpu-1g", 1.0, launched)
    spec = InstanceSpec(instance_id="spot-0", pool="spot")

    def ready() -> dict[str, float]:
        return {s.spec.instance_id: s.registered_at for s in registry.all()}

    with Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
        accounting = RunAccounting(
            ledger, "run-1", "run", (), RecordedInstances(booted, booting), ready=ready, clock=time.time, heartbeat_s=60
        )
        registry.register(spec, slots=4, ttl_s=30)
        first = ready()["spot-0"]
        accounting.begin_step(1)
        accounting.end_step(1, tokens_trained=10)
        time.sleep(0.01)
        registry.register(spec, slots=4, ttl_s=30)  # the worker restarted and registered again
        assert ready()["spot-0"] > first
        accounting.begin_step(2)
        accounting.end_step(2, tokens_trained=10)
        accounting.finish()
        boots = {i.instance_id: i.boot_s for i in ledger.report("run-1").instances}
    assert boots["spot-0"] == pytest.approx(first - launched, abs=1e-3)
    assert boots["spot-1"] is None  # never registered: no ready time
