"""A local pool whose instances cannot start (here: no model where the run says it is) fails the
step at once with their cause (exit status, last log lines), after a few backed-off restarts,
instead of relaunching them until `ready_timeout_s` and ending with "no instance registered"."""

from __future__ import annotations

import time

import pytest

from infra.providers import local
from infra.providers.local import PoolStartFailure
from infra.run.fabric_config import FabricConfig
from rl.config import RolloutConfig
from tests.helpers import rollout_fabric

pytestmark = pytest.mark.integration


def test_a_pool_whose_instances_cannot_start_fails_the_step_with_their_cause(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "RESTART_BACKOFF_S", 0.2)  # the shape of the back-off, sooner
    monkeypatch.setattr(local, "MAX_START_FAILURES", 3)
    missing = tmp_path / "no-model-here"
    missing.mkdir()
    config = FabricConfig.model_validate(
        {
            "enabled": True,
            "pools": [
                {"name": "spot", "capacity_class": "spot", "size": 1, "machine_type": "cpu", "price_per_hour": 1.0}
            ],
            "ready_timeout_s": 600,
        }
    )
    fabric = rollout_fabric(config, "cannot-start", tmp_path / "run", missing)
    try:
        started = time.monotonic()
        with pytest.raises(PoolStartFailure, match=r"pool spot: 3 instances in a row exited") as failure:
            fabric.rollout(None, [], 1, 0, RolloutConfig(), 0)
        assert time.monotonic() - started < 120  # not the 600 s ready timeout
        message = str(failure.value)
        assert "spot-2, with status 1" in message
        # the worker's own last line, from its log: what failed, on which model
        assert "worker spot-2 cannot start: its hf engine on model" in message and "no-model-here" in message
        assert len(fabric.provider.instances()) == 3  # no restart after giving up
    finally:
        fabric.close()
