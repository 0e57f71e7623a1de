"""The token log on a real 3-master Redis Cluster: a run's samples spread over the masters (each
shard's hash tag in one slot), and instances that claim from different shards see one state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster

from infra.rollout.tokenlog import GroupSpec, TokenLog
from infra.services.redis_embedded import RedisSettings

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(redis_cluster_url) -> Iterator[RedisCluster]:
    client = RedisSettings(url=redis_cluster_url).client()
    assert isinstance(client, RedisCluster), "a cluster node's URL gives a cluster client"
    yield client
    client.close()


def test_a_runs_samples_spread_over_every_master(cluster):
    log = TokenLog(cluster, "spread", shards=6)  # a fixed run id: its six slots are fixed
    log.enqueue_step(0, 0, [GroupSpec(g, [1, 2], 2, 4) for g in range(12)])
    claims = log.claim(0, "a", 0, 24)
    assert len(claims) == 24
    nodes = {cluster.get_node_from_key(log.prefixes[log.shard_of(c.sample_id)]).port for c in claims}
    masters = {node.port for node in cluster.get_primaries()}
    assert nodes == masters and len(masters) == 3
    slots = {cluster.keyslot(prefix) for prefix in log.prefixes}
    assert len(slots) == 6
    for claim in claims:
        assert log.finish(claim.sample_id, "a", claim.epoch, [3], [-0.5], "stop")
    assert sorted(log.next_completed_groups(0)) == list(range(12))
    assert log.step_status(0).complete and log.completions(0) == 12


def test_instances_start_on_different_shards_and_reaping_covers_them_all(cluster):
    log = TokenLog(cluster, "reap", shards=6)
    assert TokenLog(cluster, "reap").shards == 6, "the count is the run's: others read it"
    with pytest.raises(ValueError, match="has 6 shards, not 2: set fabric.tokenlog_shards to 6"):
        TokenLog(cluster, "reap", shards=2)
    log.enqueue_step(0, 0, [GroupSpec(g, [1, 2], 1, 4) for g in range(6)])
    first = {c.sample_id: c for c in log.claim(0, "i1", 0, 2)}
    second = {c.sample_id: c for c in log.claim(0, "i2", 0, 2)}
    assert {log.shard_of(s) for s in first} != {log.shard_of(s) for s in second}
    assert log.owners() == {"i1", "i2"}
    rest = log.claim(0, "i1", 0, 6)  # i1 moves on through the other shards
    assert len(rest) == 2 and log.running("i1") == set(first) | {c.sample_id for c in rest}
    assert log.reap("i1", max_reaps=3) == 4 and log.owners() == {"i2"}
    stale = next(iter(first.values()))
    (migrated,) = [c for c in log.claim(0, "i3", 0, 6) if c.sample_id == stale.sample_id]
    assert not log.append(stale.sample_id, "i1", stale.epoch, [9], [-0.5]), "the zombie is fenced"
    assert log.append(migrated.sample_id, "i3", migrated.epoch, [9], [-0.5])
    stats = log.stats()
    assert (stats.reaped_samples, stats.rejected_appends, stats.migrations) == (4, 1, 4)
