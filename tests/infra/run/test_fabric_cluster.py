"""Fabric steps on a real local 3-master Redis Cluster (`fabric.redis_url` names one node,
`fabric.tokenlog_shards: 6`): the co-located reserved instance in this process and a spot worker
process, weights published and pulled (and the pull reported), the controller and registry on the
cluster; every sample arrives once, and the samples live on more than one node."""

from __future__ import annotations

import time

import pytest
from redis.cluster import RedisCluster

from infra.run.fabric_config import FabricConfig
from rl.config import DataConfig, RolloutConfig
from rl.models import load_model
from rl.prompt_source import PromptSource
from tests.helpers import rollout_fabric, save_tiny_model, tiny_shape, wait_for

pytestmark = pytest.mark.integration

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
    "controller": {"reap_timeout_s": 2.0, "poll_s": 0.05},
}


def test_fabric_steps_on_a_redis_cluster_deliver_every_sample_once_from_several_nodes(redis_cluster_url, tmp_path):
    base = save_tiny_model(tmp_path / "base", tiny_shape())
    config = FabricConfig.model_validate(
        {**FAST, "redis_url": redis_cluster_url, "tokenlog_shards": 6, "pools": [RESERVED, SPOT]}
    )
    fabric = rollout_fabric(config, "on-cluster", tmp_path / "run", base)
    try:
        assert isinstance(fabric.redis, RedisCluster) and fabric.log.shards == 6
        deadline = time.time() + 90  # the spot worker process imports torch and loads the model
        while len(fabric.registry.alive()) < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert {i.spec.pool for i in fabric.registry.alive()} == {"reserved", "spot"}
        model, tokenizer = load_model(base)
        prompts = PromptSource(DataConfig(family="chain"))
        rollout = RolloutConfig(prompts_per_step=6, group_size=2, max_new_tokens=16)
        tokens: dict[str, int] = {}
        for step in (1, 2):
            fabric.publish(step - 1, model.state_dict())
            records = prompts.take(step * 100, rollout.prompts_per_step)
            samples, report = fabric.rollout(tokenizer, records, step, step - 1, rollout, run_seed=3)
            ids = [s.sample_id for s in samples]
            assert len(ids) == len(set(ids)) == 12 and not report.groups_dropped, report
            assert all(s.policy_version == step - 1 and s.response_ids for s in samples)
            nodes = {fabric.redis.get_node_from_key(fabric.log.prefixes[fabric.log.shard_of(i)]).port for i in ids}
            assert len(nodes) >= 2, f"step {step}'s samples all lived on one node: {nodes}"
            for instance, count in report.instance_tokens.items():
                tokens[instance] = tokens.get(instance, 0) + count
        transfers = []

        def pulled_and_reported() -> bool:  # the spot worker pulls version 1 through the cluster's weight keys
            transfers.extend(fabric.drain_transfers())  # (its report may land after its heartbeat says 1)
            on_one = {i.policy_version for i in fabric.registry.alive()} == {1}
            return on_one and any(t.instance_id == "spot-0" for t in transfers)

        wait_for(pulled_and_reported, "both instances on version 1, the spot worker's pull reported", timeout_s=20)
        assert set(tokens) == {"reserved-colocated", "spot-0"} and all(tokens.values()), (
            f"both instances generate, the spot worker process on its own cluster client: {tokens}"
        )
    finally:
        fabric.close()
