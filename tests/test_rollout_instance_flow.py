"""The rollout-instance flow runs a real rollout worker as a Prefect flow run: it registers,
serves work, and completes when drained."""

from __future__ import annotations

import threading
import time

import pytest

from flows.rollout_instance import rollout_instance
from infra.registry import InstanceRegistry
from rl.models import TinyLlamaShape, build_tiny_llama, save_model

pytestmark = pytest.mark.integration


def test_rollout_instance_flow_registers_and_completes_on_drain(prefect_harness, redis_url, redis_client, tmp_path):
    model, tokenizer = build_tiny_llama(TinyLlamaShape(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=64))
    save_model(model, tokenizer, tmp_path / "base")
    result: dict = {}

    def run() -> None:
        result["state"] = rollout_instance(
            pool="spot", instance_id="spot-flow-0", run_id="flow-instance", redis_url=redis_url,
            model_path=str(tmp_path / "base"), weights_dir=str(tmp_path / "weights"), return_state=True,
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    registry = InstanceRegistry(redis_client, "flow-instance")
    deadline = time.time() + 60
    try:
        while not any(i.info.instance_id == "spot-flow-0" for i in registry.alive()):
            assert time.time() < deadline, "the flow's worker never registered"
            assert thread.is_alive(), f"the flow ended early: {result}"
            time.sleep(0.1)
    finally:
        registry.request("spot-flow-0", {"op": "drain"})
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert result["state"].is_completed() and result["state"].result() == 0
    assert not any(i.info.instance_id == "spot-flow-0" for i in registry.alive())
