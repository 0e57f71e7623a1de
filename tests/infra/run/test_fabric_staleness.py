"""The version windows the fabric gives each step, against a real embedded Redis and a co-located
instance (a real worker in this process): strictly on-policy (K = 0) a step refuses the previous
version's tokens even while an instance is slow to load the new version, and with K >= 1 a step
admitted ahead takes versions step - 1 - K .. step - 1, not one more. A "slow" instance is played
by hand: token-log claims at a given version."""

from __future__ import annotations

import threading

import pytest

from infra.rollout.tokenlog import TokenLog
from infra.run.fabric_config import FabricConfig
from rl.config import DataConfig, RolloutConfig
from rl.models import load_model
from rl.prompt_source import PromptSource
from tests.helpers import RESERVED_POOL, rollout_fabric, save_tiny_model, tiny_shape, wait_for

pytestmark = pytest.mark.integration

FAST = {
    "enabled": True,
    "pools": [{**RESERVED_POOL, "colocated": True}],
    "worker": {"slots": 4, "flush_tokens": 2, "flush_ms": 20, "heartbeat_s": 0.2, "ttl_s": 1.0},
    "controller": {"poll_s": 0.05},
}
ROLLOUT = RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=8)
PROMPTS = PromptSource(DataConfig(family="chain"))


class Run:
    """A fabric whose one instance is the co-located one, its base model's weights and tokenizer."""

    def __init__(self, fabric, model, tokenizer) -> None:
        self.fabric, self.tokenizer = fabric, tokenizer
        self.weights = {k: v.clone() for k, v in model.state_dict().items()}
        self.worker = fabric.colocated[0]

    def publish(self, version: int) -> None:
        self.fabric.publish(version, self.weights)  # the same weights: a version is what matters here

    def rollout(self, step: int, version: int, staleness: int = 0, ahead: tuple[int, ...] = ()):
        return self.fabric.rollout(
            self.tokenizer,
            PROMPTS.take(step * 10, ROLLOUT.prompts_per_step),
            step,
            version,
            ROLLOUT,
            run_seed=3,
            staleness=staleness,
            ahead=[(later, PROMPTS.take(later * 10, ROLLOUT.prompts_per_step)) for later in ahead],
        )


def _admitted(log: TokenLog, step: int) -> bool:
    try:
        log.step_status(step)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = save_tiny_model(tmp_path_factory.mktemp("fabric-staleness") / "base", tiny_shape())
    config = FabricConfig.model_validate(FAST)
    fabric = rollout_fabric(config, "fabric-staleness", tmp_path_factory.mktemp("run"), base)
    try:
        model, tokenizer = load_model(base)
        run = Run(fabric, model, tokenizer)
        run.publish(0)
        yield run
    finally:
        fabric.close()


def test_a_strict_step_refuses_the_previous_version_while_an_instance_is_slow_to_load(run):
    samples, _ = run.rollout(1, 0)
    assert {s.policy_version for s in samples} == {0}
    # Step 2 trains from version 1, which is not published yet: every instance still holds version 0.
    result: dict = {}

    def roll() -> None:
        try:
            result["samples"] = run.rollout(2, 1)[0]
        except BaseException as error:  # reported by the assertion below
            result["error"] = error

    thread = threading.Thread(target=roll)
    thread.start()
    try:
        log = run.fabric.log
        wait_for(lambda: _admitted(log, 2), "step 2 in the token log")
        assert log.claim(2, "slow", policy_version=0, max_samples=4) == []  # version 0 is not step 2's
        assert log.step_status(2).running == 0 and log.step_status(2).min_version == 1
    finally:
        run.publish(1)  # the instance loads version 1 and generates the step
        thread.join(60)
    assert not thread.is_alive() and "error" not in result, result
    assert all(s.policy_version == 1 and set(s.versions()) == {1} for s in result["samples"])


def test_a_step_admitted_ahead_takes_k_versions_before_its_own_and_no_older(run):
    """K = 1: step 4, admitted while step 3 rolls out, trains from version 3 and takes 2 and 3.
    The instance holds version 1 (step 3's oldest); version 2 is never published."""
    wait_for(lambda: run.worker.worker.engine.policy_version == 1, "the instance at version 1")
    samples, _ = run.rollout(3, 2, staleness=1, ahead=(4,))
    assert {v for s in samples for v in s.versions()} == {1}  # step 3 takes versions 1 and 2
    log = run.fabric.log
    status = log.step_status(4)
    assert status.running == status.done == 0, "the instance at version 1 generated step 4"
    assert log.claim(4, "slow", policy_version=1, max_samples=4) == []
    assert (status.policy_version, status.min_version) == (3, 2)
    claims = log.claim(4, "slow", policy_version=2, max_samples=1)
    assert len(claims) == 1
    assert log.release(claims[0].sample_id, "slow", claims[0].epoch, keep_tokens=True)
