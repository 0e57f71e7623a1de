"""The rollout-instance flow runs a real rollout worker as a Prefect flow run: it registers,
serves work, completes when drained, and ends Crashed (saying so) after a preemption notice."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from flows.rollout_instance import rollout_instance
from infra.rollout.control import Drain
from infra.rollout.registry import InstanceRegistry
from tests.helpers import save_tiny_model

pytestmark = pytest.mark.integration


def _serve_until_registered_then_drain(redis_client, **parameters):
    """Run the flow on a thread until its worker registers, then drain it; the flow's final state."""
    result: dict = {}

    def run() -> None:
        result["state"] = rollout_instance(**parameters, return_state=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    instance_id = parameters["instance_id"]
    registry = InstanceRegistry(redis_client, parameters["run_id"])
    deadline = time.time() + 60
    try:
        while not any(i.spec.instance_id == instance_id for i in registry.alive()):
            assert time.time() < deadline, "the flow's worker never registered"
            assert thread.is_alive(), f"the flow ended early: {result}"
            time.sleep(0.1)
    finally:
        registry.request(instance_id, Drain())
        thread.join(timeout=30)
    assert not thread.is_alive()
    return result["state"]


def test_rollout_instance_flow_registers_and_completes_on_drain(prefect_harness, redis_url, redis_client, tmp_path):
    save_tiny_model(tmp_path / "base")
    state = _serve_until_registered_then_drain(
        redis_client,
        pool="spot",
        capacity_class="spot",
        price_per_hour=0.0,
        instance_id="spot-flow-0",
        run_id="flow-instance",
        redis_url=redis_url,
        model_path=str(tmp_path / "base"),
    )
    assert state.is_completed() and state.result() == 0
    registry = InstanceRegistry(redis_client, "flow-instance")
    assert not any(i.spec.instance_id == "spot-flow-0" for i in registry.alive())


def test_sigterm_drains_the_instance_and_ends_the_run_crashed(
    prefect_harness, redis_url, redis_client, tmp_path, monkeypatch
):
    """The notice reaches the flow's process (here: this one, the flow runs on the main thread):
    the worker hands everything back, deregisters, and the run ends Crashed naming the signal.
    The Redis URL comes from the environment, as the prefect instance provider passes it."""
    save_tiny_model(tmp_path / "base")
    monkeypatch.setenv("RLBOOST_REDIS_URL", redis_url)
    registry = InstanceRegistry(redis_client, "flow-preempt")
    previous = signal.getsignal(signal.SIGTERM)
    stop_watching = threading.Event()

    def preempt_once_registered() -> None:
        deadline = time.time() + 60
        while not stop_watching.is_set() and time.time() < deadline:
            if any(i.spec.instance_id == "spot-flow-1" for i in registry.alive()):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=preempt_once_registered, daemon=True)
    watcher.start()
    try:
        state = rollout_instance(
            pool="spot",
            capacity_class="spot",
            price_per_hour=0.0,
            instance_id="spot-flow-1",
            run_id="flow-preempt",
            model_path=str(tmp_path / "base"),
            return_state=True,
        )
    finally:
        stop_watching.set()
        watcher.join()
    assert state.is_crashed(), state
    assert state.message.startswith("preempted: SIGTERM received; instance spot-flow-1")
    assert signal.getsignal(signal.SIGTERM) is previous, "the flow must restore the handler it replaced"
    assert not registry.all(), "a drained instance deregisters"


def test_a_cloud_instance_reads_its_secrets_from_the_runs_secret_block(
    prefect_harness, redis_url, redis_client, tmp_path, monkeypatch
):
    from prefect.blocks.system import Secret

    from flows.rollout_instance import load_environment
    from infra.services.redis_embedded import REDIS_URL_ENV

    save_tiny_model(tmp_path / "base")
    for name in (REDIS_URL_ENV, "RLBOOST_WEIGHTS_SECRET"):  # absent again after the test
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    Secret(value={REDIS_URL_ENV: redis_url, "RLBOOST_WEIGHTS_SECRET": "s" * 32}).save(
        "rlboost-flow-env-instances", overwrite=True
    )
    state = _serve_until_registered_then_drain(  # no redis_url parameter: it comes from the block
        redis_client,
        pool="spot",
        capacity_class="spot",
        price_per_hour=0.0,
        instance_id="spot-env-0",
        run_id="flow-env",
        model_path=str(tmp_path / "base"),
        environment_block="rlboost-flow-env-instances",
    )
    assert state.is_completed()
    assert os.environ["RLBOOST_WEIGHTS_SECRET"] == "s" * 32

    # What the environment already has wins; a block that is not a mapping is refused by name.
    monkeypatch.setenv("RLBOOST_WEIGHTS_SECRET", "mine")
    assert load_environment("rlboost-flow-env-instances") == [] and os.environ["RLBOOST_WEIGHTS_SECRET"] == "mine"
    Secret(value="just-a-string").save("rlboost-not-a-mapping", overwrite=True)
    with pytest.raises(ValueError, match="Secret block 'rlboost-not-a-mapping' must hold a mapping"):
        load_environment("rlboost-not-a-mapping")


def test_a_gpu_vms_instance_without_cuda_fails_its_run_saying_so_instead_of_decoding_on_its_cpu(
    prefect_harness, redis_url, tmp_path
):
    """The flow run of a `g2` VM, with the parameters the run gives it (`InstanceRunSpec`), run on
    this CPU-only machine: as on a GPU VM whose driver is missing."""
    from infra.fleet.instance_runs import InstanceRunSpec
    from infra.providers.pool import PoolSpec
    from infra.rollout.settings import WorkerSettings
    from rl.engine_spec import EngineSpec

    save_tiny_model(tmp_path / "base")
    pool = PoolSpec.model_validate(
        {
            "name": "l4-spot",
            "provider": "gcp",
            "capacity_class": "spot",
            "size": 1,
            "machine_type": "g2-standard-8",
            "price_per_hour": 0.3,
            "gcp": {"project": "rollout-proj", "zones": ["us-central1-a"], "image": "img"},
        }
    )
    spec = InstanceRunSpec(
        run_id="flow-gpu",
        redis_url=redis_url,
        model=str(tmp_path / "base"),
        worker=WorkerSettings(),
        engine=EngineSpec(),  # device auto
    )
    parameters = spec.parameters(pool, "l4-spot-0a1b2c3d")
    assert parameters["engine"]["device"] == "cuda"  # the run's `auto` on a machine type with GPUs
    state = rollout_instance(**parameters, redis_url=redis_url, return_state=True)
    assert state.is_failed(), state
    assert "rollout instance l4-spot-0a1b2c3d cannot start: its engine failed: DeviceError:" in state.message
    assert "engine.device: cuda asked for, but this machine has no usable CUDA device" in state.message
    assert "is the GPU driver installed?" in state.message
