"""The instance registry against a real redis-server: heartbeats, TTL lapse, control messages."""

from __future__ import annotations

import time
import uuid

import pytest
from pydantic import ValidationError

from infra.rollout.control import ROUTE_S, Drain, Release, ReleaseAll, Resume, Unknown, decode, encode
from infra.rollout.instance import InstanceSpec
from infra.rollout.registry import InstanceRegistry

pytestmark = pytest.mark.integration

TTL_S = 0.3
"""Each instance's liveness lapses this long after its registration or last heartbeat."""


@pytest.fixture
def registry(redis_client) -> InstanceRegistry:
    return InstanceRegistry(redis_client, f"test-{uuid.uuid4().hex[:8]}")


def spot(instance_id: str) -> InstanceSpec:
    return InstanceSpec(instance_id=instance_id, pool="local-spot", capacity_class="spot", price_per_hour=0.25)


def test_register_heartbeat_snapshot(registry):
    registry.register(spot("b"), slots=8, ttl_s=TTL_S)
    registry.register(
        InstanceSpec(instance_id="a", pool="local-reserved", capacity_class="reserved", price_per_hour=2.0),
        slots=4,
        ttl_s=TTL_S,
    )
    before = registry.all()
    assert [s.spec.instance_id for s in before] == ["a", "b"]
    assert before[1].spec == spot("b") and before[1].slots == 8
    assert before[1].alive and before[1].last_heartbeat is None
    assert before[1].policy_version is None
    assert before[1].free_slots == 8 and abs(before[1].registered_at - time.time()) < 5
    assert registry.heartbeat("b", policy_version=3, free_slots=5, running=3, ttl_s=TTL_S)
    (b,) = [s for s in registry.alive() if s.spec.instance_id == "b"]
    assert (b.policy_version, b.free_slots, b.running) == (3, 5, 3)
    assert b.last_heartbeat is not None and abs(b.last_heartbeat - time.time()) < 5
    assert not registry.heartbeat("nobody", 0, 1, 0, TTL_S)
    assert b.awaiting == frozenset()
    assert registry.heartbeat("b", 3, 5, 3, TTL_S, awaiting=["3/1/0", "3/0/2"])  # trajectories at a tool
    (b,) = [s for s in registry.alive() if s.spec.instance_id == "b"]
    assert b.awaiting == {"3/0/2", "3/1/0"}


def test_the_hash_of_an_instance_keeps_its_encoding(registry):
    """What an instance's registration writes, field by field (a registry of an earlier version reads it)."""
    registry.register(spot("s1"), slots=8, ttl_s=TTL_S)
    stored = registry.client.hgetall(registry.prefix + "i:s1")
    assert float(stored.pop(b"registered_at")) > 0
    assert stored == {
        b"pool": b"local-spot",
        b"capacity_class": b"spot",
        b"price_per_hour": b"0.25",
        b"slots": b"8",
        b"free_slots": b"8",
        b"running": b"0",
    }


def test_not_alive_after_ttl_and_back_with_heartbeat(registry):
    registry.register(spot("s1"), slots=8, ttl_s=TTL_S)
    registry.register(spot("s2"), slots=8, ttl_s=TTL_S)
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        assert registry.heartbeat("s1", 0, 8, 0, TTL_S)
        time.sleep(0.05)
    assert [s.spec.instance_id for s in registry.alive()] == ["s1"]
    assert [s.spec.instance_id for s in registry.all()] == ["s1", "s2"]  # lapsed, still registered
    assert registry.heartbeat("s2", 0, 8, 0, TTL_S)
    assert [s.spec.instance_id for s in registry.alive()] == ["s1", "s2"]


def test_deregistered_instance_is_told_to_stop(registry):
    registry.register(spot("s1"), slots=8, ttl_s=TTL_S)
    registry.request("s1", Drain())
    assert registry.deregister("s1")
    assert not registry.deregister("s1")
    assert not registry.heartbeat("s1", 0, 8, 0, TTL_S)
    assert registry.all() == [] and registry.poll_requests("s1") == []


def test_control_messages_are_fifo(registry):
    registry.register(spot("s1"), slots=8, ttl_s=TTL_S)
    commands = [Release(count=3), Release(("0/1/2",), to="s2", route_s=2.5), ReleaseAll(4), Resume(), Drain()]
    for command in commands:
        assert registry.request("s1", command)
    assert registry.poll_requests("s1") == commands
    assert registry.poll_requests("s1") == []
    assert not registry.request("ghost", Drain())


def test_a_control_message_of_an_unknown_kind_is_read_as_unknown(registry, redis_client):
    """A newer controller's message (or garbage) reaches an older worker as `Unknown`, not an error."""
    registry.register(spot("s1"), slots=8, ttl_s=TTL_S)
    registry.request("s1", Drain())
    redis_client.rpush(registry.prefix + "ctl:s1", '{"op": "defragment"}', "not json")
    assert registry.poll_requests("s1") == [Drain(), Unknown('{"op": "defragment"}'), Unknown("not json")]
    assert decode(encode(Release(count=2))) == Release(count=2) and Release().route_s == ROUTE_S


def test_instance_spec_validation(registry):
    with pytest.raises(ValidationError, match="capacity_class"):
        InstanceSpec(instance_id="x", pool="pool", capacity_class="preemptible")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="price_per_hour"):
        InstanceSpec(instance_id="x", pool="pool", price_per_hour=-1.0)
    with pytest.raises(ValidationError, match="instance_id must be non-empty and printable"):
        InstanceSpec(instance_id="a\nb", pool="pool")
    with pytest.raises(ValidationError, match="pool"):
        InstanceSpec(instance_id="x", pool="")
    with pytest.raises(ValueError, match="slots"):
        registry.register(spot("x"), slots=0, ttl_s=TTL_S)
    with pytest.raises(ValueError, match="ttl_s"):
        registry.register(spot("x"), slots=1, ttl_s=0)
