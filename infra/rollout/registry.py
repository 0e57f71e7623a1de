"""The instance registry: which rollout instances a run has, whether they are alive, and the
control messages the controller sends them (docs/internals.md §3).

This module owns the registry's Redis state. An instance `register`s, then `heartbeat`s well
within its `ttl_s` (`fabric.worker.ttl_s`); each heartbeat refreshes a liveness key that expires
after `ttl_s` (what `alive` reads) and records, on the server's clock, its policy version, the
sha of the weights it decodes with, free slots and running samples.
Reaping reads heartbeat age, not the liveness key (`policies.reaper`); a deregistered instance's
heartbeat returns False, which tells it to stop. Control messages (`infra.rollout.control`) go
through a FIFO list per instance (`request`; taken by `poll_requests` or `wait_request`).

Key layout (``P = "rlb:{<run_id>}:reg:"``): ``P members`` (set of instance ids), ``P i:<id>``
(hash: spec, slots and last heartbeat), ``P alive:<id>`` (liveness key with TTL), ``P ctl:<id>``
(list of JSON control messages).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import cast

import redis

from infra.availability.capacity import CapacityClass
from infra.keyspace import registry_prefix
from infra.rollout.control import ControlMessage, Unknown, decode, encode
from infra.rollout.instance import InstanceSpec


@dataclass(frozen=True)
class InstanceSnapshot:
    spec: InstanceSpec
    slots: int
    """Samples the instance generates concurrently."""
    alive: bool
    """The liveness key has not expired."""
    registered_at: float
    """Unix seconds, server clock."""
    last_heartbeat: float | None
    """Unix seconds, server clock; None before the first heartbeat."""
    policy_version: int | None
    free_slots: int
    running: int
    weights_sha: str | None = None
    """The sha of the weights it decodes with (`infra.weights.manifest.fingerprint` of the state
    it loaded; None: the base model it started on, or not reported)."""
    awaiting: frozenset[str] = frozenset()
    """Its trajectories whose turn ended and that wait for their environment's answer."""


# KEYS[1] = members set; ARGV: P, id, ttl_ms, then field/value pairs to set
_REGISTER = """
local P, id = ARGV[1], ARGV[2]
local t = redis.call('TIME')
redis.call('SADD', KEYS[1], id)
redis.call('DEL', P .. 'i:' .. id)
redis.call('HSET', P .. 'i:' .. id, 'registered_at', t[1] .. '.' .. string.format('%06d', t[2]),
  unpack(ARGV, 4))
redis.call('SET', P .. 'alive:' .. id, 1, 'PX', ARGV[3])
return 1
"""

# KEYS[1] = members set; ARGV: P, id, ttl_ms, version ('' = none), free slots, running, sha ('' = none),
# awaiting (sample ids, space-separated)
_HEARTBEAT = """
local P, id = ARGV[1], ARGV[2]
if redis.call('SISMEMBER', KEYS[1], id) == 0 then return 0 end
local t = redis.call('TIME')
redis.call('SET', P .. 'alive:' .. id, 1, 'PX', ARGV[3])
redis.call('HSET', P .. 'i:' .. id, 'heartbeat_at', t[1] .. '.' .. string.format('%06d', t[2]),
  'version', ARGV[4], 'free_slots', ARGV[5], 'running', ARGV[6], 'sha', ARGV[7], 'awaiting', ARGV[8])
return 1
"""

# KEYS[1] = members set; ARGV: P, id, message
_REQUEST = """
if redis.call('SISMEMBER', KEYS[1], ARGV[2]) == 0 then return 0 end
redis.call('RPUSH', ARGV[1] .. 'ctl:' .. ARGV[2], ARGV[3])
return 1
"""


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ttl_ms(ttl_s: float) -> int:
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    return max(1, round(ttl_s * 1000))


class InstanceRegistry:
    """One run's rollout instances on a Redis server."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        if not run_id or any(c in run_id for c in "{}") or not run_id.isprintable():
            raise ValueError(f"run_id must be non-empty, printable, without braces: {run_id!r}")
        self.client = client
        self.run_id = run_id
        self.prefix = registry_prefix(run_id)
        self._members = self.prefix + "members"
        self._register = client.register_script(_REGISTER)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._request = client.register_script(_REQUEST)

    def register(self, spec: InstanceSpec, slots: int, ttl_s: float) -> None:
        """Add (or re-register) an instance that generates up to `slots` samples at once; it counts
        as alive for `ttl_s`."""
        if slots < 1:
            raise ValueError(f"instance {spec.instance_id}: slots must be >= 1, got {slots}")
        fields = [
            "pool",
            spec.pool,
            "capacity_class",
            spec.capacity_class,
            "price_per_hour",
            repr(float(spec.price_per_hour)),
            "slots",
            slots,
            "free_slots",
            slots,
            "running",
            0,
        ]
        self._register(keys=[self._members], args=[self.prefix, spec.instance_id, _ttl_ms(ttl_s), *fields])

    def heartbeat(
        self,
        instance_id: str,
        policy_version: int | None,
        free_slots: int,
        running: int,
        ttl_s: float,
        weights_sha: str | None = None,
        awaiting: Collection[str] = (),
    ) -> bool:
        """Refresh liveness (for `ttl_s`), load, the weights served and the trajectories `awaiting`
        their environment; False if the instance is not registered (it was evicted and must stop)."""
        version = "" if policy_version is None else policy_version
        args = [self.prefix, instance_id, _ttl_ms(ttl_s), version, free_slots, running, weights_sha or ""]
        args.append(" ".join(sorted(awaiting)))
        return bool(self._heartbeat(keys=[self._members], args=args))

    def deregister(self, instance_id: str) -> bool:
        """Forget an instance and its pending control messages; False if it was not registered."""
        pipe = self.client.pipeline(transaction=True)
        pipe.srem(self._members, instance_id)
        pipe.delete(*(self.prefix + k + instance_id for k in ("i:", "alive:", "ctl:")))
        removed, _ = pipe.execute()
        return bool(removed)

    def all(self) -> list[InstanceSnapshot]:
        """Every registered instance, alive or not, sorted by id."""
        ids = sorted(_str(m) for m in self.client.smembers(self._members))
        pipe = self.client.pipeline(transaction=False)
        for instance_id in ids:
            pipe.hgetall(self.prefix + "i:" + instance_id)
            pipe.exists(self.prefix + "alive:" + instance_id)
        replies = pipe.execute()
        snapshots = []
        for instance_id, info, alive in zip(ids, replies[::2], replies[1::2]):
            if not info:  # deregistered between the two reads
                continue
            field = {_str(k): _str(v) for k, v in info.items()}
            snapshots.append(
                InstanceSnapshot(
                    spec=InstanceSpec(
                        instance_id=instance_id,
                        pool=field["pool"],
                        capacity_class=cast(CapacityClass, field["capacity_class"]),  # InstanceSpec checks it
                        price_per_hour=float(field["price_per_hour"]),
                    ),
                    slots=int(field["slots"]),
                    alive=bool(alive),
                    registered_at=float(field["registered_at"]),
                    last_heartbeat=(float(field["heartbeat_at"]) if "heartbeat_at" in field else None),
                    policy_version=int(field["version"]) if field.get("version") else None,
                    free_slots=int(field["free_slots"]),
                    running=int(field["running"]),
                    weights_sha=field.get("sha") or None,
                    awaiting=frozenset(field.get("awaiting", "").split()),
                )
            )
        return snapshots

    def alive(self) -> list[InstanceSnapshot]:
        """Registered instances whose liveness key has not expired."""
        return [s for s in self.all() if s.alive]

    def request(self, instance_id: str, message: ControlMessage) -> bool:
        """Queue a control message for an instance; False if it is not registered."""
        return bool(self._request(keys=[self._members], args=[self.prefix, instance_id, encode(message)]))

    def poll_requests(self, instance_id: str) -> list[ControlMessage | Unknown]:
        """Take the instance's pending control messages, oldest first."""
        key = self._ctl_key(instance_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(key, 0, -1)
        pipe.delete(key)
        messages, _ = pipe.execute()
        return [decode(m) for m in messages]

    def wait_request(self, instance_id: str, timeout_s: float) -> ControlMessage | Unknown | None:
        """Take the instance's oldest control message, waiting up to `timeout_s` for one (None if
        none came). The client's socket_timeout must exceed `timeout_s`."""
        reply = self.client.blpop([self._ctl_key(instance_id)], timeout=timeout_s)
        return None if reply is None else decode(reply[1])

    def _ctl_key(self, instance_id: str) -> str:
        return self.prefix + "ctl:" + instance_id
