"""A co-located reserved instance on the fabric, against a real embedded Redis and a real spot
worker process: it runs in this (the training) process, takes each version from `publish` with
no pull, releases at `T_local` and sleeps, finishes the step itself when no spot instance is
left, is recorded in the ledger at its pool's price, and a failure of its engine fails the step
naming its pool."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from infra.ledger.recorder import Ledger
from infra.run.accounting import RunAccounting
from infra.run.colocated import ColocatedInstanceError
from infra.run.fabric import RolloutFabric
from infra.run.fabric_config import FabricConfig
from rl.config import DataConfig, RolloutConfig
from rl.models import load_model
from rl.prompt_source import PromptSource
from tests.helpers import rollout_fabric, save_tiny_model, tiny_shape

pytestmark = pytest.mark.integration

T_LOCAL_S = 0.3
RESERVED = {
    "name": "reserved",
    "capacity_class": "reserved",
    "size": 1,
    "machine_type": "a2-highgpu-1g",
    "price_per_hour": 3.67,
    "colocated": True,
}
SPOT = {"name": "spot", "capacity_class": "spot", "size": 1, "machine_type": "a2-highgpu-1g", "price_per_hour": 1.1}
FAST = {
    "enabled": True,
    "worker": {"slots": 4, "flush_tokens": 2, "flush_ms": 20, "heartbeat_s": 0.2, "ttl_s": 1.0},
    "controller": {
        "reap_timeout_s": 2.0,
        "poll_s": 0.05,
        "offload": {"initial_t_local_s": T_LOCAL_S, "floor_s": T_LOCAL_S, "ceiling_s": T_LOCAL_S},
    },
}
PROMPTS = PromptSource(DataConfig(family="chain"))


def version_weights(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """A distinct, deterministic policy per version (stands in for an optimizer step)."""
    generator = torch.Generator().manual_seed(version)
    return {k: v + 0.02 * version * torch.randn(v.shape, generator=generator) for k, v in base.items()}


class Run:
    """A fabric, its base model (a reference to load versions into) and tokenizer, and the last step."""

    def __init__(self, fabric: RolloutFabric, model, tokenizer) -> None:
        self.fabric, self.reference, self.tokenizer = fabric, model, tokenizer
        self.base = {k: v.clone() for k, v in model.state_dict().items()}
        self.step = 0
        self.colocated = fabric.colocated[0]

    def rollout(self, rollout: RolloutConfig):
        """Publish the next version and roll out the next step on it; checks exactly-once delivery."""
        self.step += 1
        version = self.step - 1
        self.fabric.publish(version, version_weights(self.base, version))
        records = PROMPTS.take(self.step * 100, rollout.prompts_per_step)
        samples, report = self.fabric.rollout(self.tokenizer, records, self.step, version, rollout, run_seed=3)
        ids = [s.sample_id for s in samples]
        assert len(ids) == len(set(ids)) == rollout.prompts_per_step * rollout.group_size, report
        assert not report.groups_dropped and all(s.policy_version == version for s in samples)
        return samples, report


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("colocated") / "base"
    save_tiny_model(path, tiny_shape())
    return path


@pytest.fixture(scope="module")
def run(base_model, tmp_path_factory):
    config = FabricConfig.model_validate({**FAST, "pools": [RESERVED, SPOT]})
    fabric = rollout_fabric(config, "colocated", tmp_path_factory.mktemp("run"), base_model)
    try:
        deadline = time.time() + 90  # the spot worker process imports torch and loads the model
        while len(fabric.registry.alive()) < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert {i.spec.pool for i in fabric.registry.alive()} == {"reserved", "spot"}
        model, tokenizer = load_model(base_model)
        yield Run(fabric, model, tokenizer)
    finally:
        fabric.close()


def test_the_colocated_instance_is_a_reserved_instance_of_its_pool_in_this_process(run):
    (spec,) = [i.spec for i in run.fabric.registry.alive() if i.spec.pool == "reserved"]
    assert (spec.instance_id, spec.capacity_class) == ("reserved-colocated", "reserved")
    assert run.colocated._thread.is_alive() and not [
        r for r in run.fabric.provider.inner.instances() if r.pool == "reserved"
    ], "no process was launched for the colocated pool"


def test_versions_come_from_publish_without_a_pull(run):
    rollout = RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=8)
    for _ in range(2):
        run.rollout(rollout)
        version = run.step - 1
        engine = run.colocated.worker.engine.inner
        assert engine.policy_version == version
        run.reference.load_state_dict(version_weights(run.base, version))  # as tied weights load
        expected = run.reference.state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in engine.model.state_dict().items())
    assert run.colocated.worker.stats.weight_loads == 1, "version 0 is the base model; version 1 was loaded"
    deadline = time.time() + 20  # the spot worker pulls version 1 (and reports it) on its own time
    while time.time() < deadline and {i.policy_version for i in run.fabric.registry.alive()} != {1}:
        time.sleep(0.05)
    pulled = {t.instance_id for t in run.fabric.drain_transfers()}
    assert "reserved-colocated" not in pulled and any(i.startswith("spot-") for i in pulled), pulled


def test_reserved_releases_at_t_local_sleeps_and_every_sample_arrives_once(run, tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    accounting = RunAccounting(ledger, run.fabric.run_id, "colocated", run.fabric.config.pools, run.fabric.provider)
    stats = run.colocated.worker.stats
    sleeps, released = stats.sleeps, stats.released
    step = run.step + 1
    accounting.begin_step(step)
    # Long enough that the reserved instance still holds unfinished samples at T_local on a fast
    # host (32 samples of up to 64 tokens took 0.39 s on one, so it had none left to release).
    samples, report = run.rollout(RolloutConfig(prompts_per_step=16, group_size=4, max_new_tokens=128))
    assert report.step_time_s > 2 * T_LOCAL_S, report
    accounting.end_step(step, sum(len(s.response_ids) for s in samples), report.instance_tokens, report.tokens_wasted)
    print(f"T_local step: {report}")
    assert report.t_local_s == pytest.approx(T_LOCAL_S) and report.num_spot == 1
    assert stats.released > released and stats.sleeps == sleeps + 1
    assert report.instance_tokens["reserved-colocated"] > 0
    assert sum(v for k, v in report.instance_tokens.items() if k.startswith("spot-")) > 0

    costs = ledger.report(run.fabric.run_id)
    ledger.close()
    (mine,) = [i for i in costs.instances if i.instance_id == "reserved-colocated"]
    assert (mine.pool, mine.capacity_class, mine.usd_per_hour) == ("reserved", "reserved", 3.67)
    assert mine.billed_seconds > 0 and costs.spend("reserved") > 0
    # It runs on the trainer's machine: recorded once, as the trainer.
    assert mine.role == "trainer" and costs.trainer_recorded and costs.trainer_usd == pytest.approx(mine.spend_usd)


def test_an_evicted_colocated_instance_registers_again_and_generates(run):
    """Its heartbeats lapsed (deregistered, as the reaper does): it comes back, as a replacement would."""
    evicted = run.colocated.worker
    run.fabric.registry.deregister("reserved-colocated")
    deadline = time.time() + 10
    while time.time() < deadline and not (
        run.colocated.worker is not evicted
        and "reserved-colocated" in {i.spec.instance_id for i in run.fabric.registry.alive()}
    ):
        time.sleep(0.02)
    assert run.colocated.worker is not evicted and evicted.stop_reason == "evicted"
    run.colocated.check()  # not a failure
    _, report = run.rollout(RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=16))
    assert report.instance_tokens.get("reserved-colocated", 0) > 0


def test_with_no_spot_instance_left_the_colocated_instance_finishes_the_step(run):
    """Every spot instance goes away after the release: the controller resumes the reserved one."""
    stats = run.colocated.worker.stats
    sleeps, claimed = stats.sleeps, stats.claimed
    result: dict = {}

    def roll() -> None:
        try:
            result["report"] = run.rollout(RolloutConfig(prompts_per_step=12, group_size=4, max_new_tokens=64))[1]
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=roll)
    thread.start()
    deadline = time.time() + 30
    while stats.sleeps == sleeps and thread.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    assert stats.sleeps == sleeps + 1, "the reserved instance should have released and slept"
    after_release = stats.claimed
    for record in run.fabric.provider.instances(live_only=True):
        if record.pool == "spot":
            run.fabric.provider.terminate(record.instance_id, "scaled_down")
    thread.join(60)
    assert not thread.is_alive() and "error" not in result, result
    assert stats.claimed > after_release > claimed, "it claimed again after the spot instance left"
    assert not [i for i in run.fabric.registry.alive() if i.spec.pool == "spot"]


def test_a_failing_colocated_engine_fails_the_step_naming_its_pool(base_model, tmp_path):
    config = FabricConfig.model_validate({**FAST, "pools": [RESERVED]})
    fabric = rollout_fabric(config, "colocated-fails", tmp_path / "run", base_model)
    try:
        _, tokenizer = load_model(base_model)
        fabric.publish(1, {"not.a.weight": torch.zeros(1)})  # the engine's load_state_dict raises
        rollout = RolloutConfig(prompts_per_step=1, group_size=2, max_new_tokens=4)
        started = time.monotonic()
        with pytest.raises(ColocatedInstanceError, match=r"reserved-colocated of pool 'reserved'.*not\.a\.weight"):
            fabric.rollout(tokenizer, PROMPTS.take(0, 1), 1, 1, rollout, run_seed=0)
        assert time.monotonic() - started < 10
    finally:
        fabric.close()
