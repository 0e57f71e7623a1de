"""`HolderRegistry`: the run's weight-transfer state in Redis.

This module owns
* `latest`: the newest announced version (``rlb:{<run_id>}:latest_version``, announced on the
  pub/sub channel ``rlb:{<run_id>}:weights``); `announce` only moves it forward (one Lua script);
* manifest digests: each published version's manifest sha256, written before the version is
  announced; a puller checks the manifest it fetched anywhere against it, every chunk against that;
* holders: which peer URLs serve which version, whole or in part (instances still pulling it, with
  the chunks each holds and those it is fetching); pull leases: which versions instances are
  pulling now, so that store retention keeps them. All expire `ttl_s` after their last refresh
  (Redis's clock); a daemon thread refreshes this registry's own every `ttl_s / 3`; `close`
  removes them at once.
Keys (``P = "rlb:{<run_id>}:w:"``): ``P manifests`` (hash: version -> sha256), ``P holders:<v>``,
``P partial:<v>`` and ``P leases`` (sorted sets: URL, or ``<v>:<owner>``, scored by expiry, ms),
``P have:<v>`` (hash: partial holder's URL -> `chunk_bitmap`s held + fetching). docs/internals.md §6.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import redis

from infra import keyspace

log = logging.getLogger(__name__)


def latest_version_key(run_id: str) -> str:
    """Redis key holding the newest announced version (a decimal string)."""
    return keyspace.latest_version_key(run_id)


def weights_channel(run_id: str) -> str:
    """Pub/sub channel on which each newly announced version is published (message: the version)."""
    return keyspace.weights_channel(run_id)


def latest_version(client: redis.Redis, run_id: str) -> int | None:
    """The newest announced version, or None before the first announcement."""
    value = client.get(latest_version_key(run_id))
    return None if value is None else int(value)


_ADVANCE = """
local cur = redis.call('GET', KEYS[1])
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('PUBLISH', KEYS[2], ARGV[1])
return 1
"""
_REFRESH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
for i = 1, #KEYS do redis.call('PEXPIRE', KEYS[i], ARGV[2]) end
if ARGV[3] then redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) end
return 1
"""
_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
"""
_LIVE_BITMAPS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
if #live == 0 then return {{}, {}} end
return {live, redis.call('HMGET', KEYS[2], unpack(live))}
"""


def chunk_bitmap(total: int) -> bytearray:
    """An empty bitmap for a version of `total` chunks: chunk i is bit i % 8 of byte i // 8."""
    return bytearray((total + 7) // 8)


def mark_chunk(bitmap: bytearray, index: int, present: bool = True) -> None:
    """Set (or with `present=False` clear) chunk `index` in `bitmap` (made by `chunk_bitmap`)."""
    if present:
        bitmap[index // 8] |= 1 << index % 8
    else:
        bitmap[index // 8] &= ~(1 << index % 8)


def chunks_in(bitmap: bytes) -> frozenset[int]:
    """The chunk indices set in `bitmap`."""
    return frozenset(8 * i + bit for i, byte in enumerate(bitmap) if byte for bit in range(8) if byte >> bit & 1)


class PartialHolder(NamedTuple):
    held: frozenset[int]
    """The chunks it serves (verified)."""
    fetching: frozenset[int]
    """The chunks it has asked a source for and not received yet."""


class HolderRegistry:
    def __init__(self, client: redis.Redis, run_id: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.client = client
        self.run_id = run_id
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._prefix = keyspace.weights_prefix(run_id)
        self._advance = client.register_script(_ADVANCE)
        self._refresh = client.register_script(_REFRESH)
        self._live = client.register_script(_LIVE)
        self._live_bitmaps = client.register_script(_LIVE_BITMAPS)
        self._own: dict[tuple[str, str], tuple[str, ...]] = {}
        """(key, member) entries this process keeps alive -> every key to refresh with it (the entry's
        sorted set first, then a hash holding a field per member, for partial holders)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._keep_alive, name=f"weights-holders-{run_id}", daemon=True)
        self._heartbeat.start()

    # latest ------------------------------------------------------------------------------------

    def announce(self, version: int) -> bool:
        """Make `version` the latest if it is newer (and PUBLISH it); whether it advanced."""
        keys = [latest_version_key(self.run_id), weights_channel(self.run_id)]
        return bool(self._advance(keys=keys, args=[version]))

    def latest(self) -> int | None:
        return latest_version(self.client, self.run_id)

    # manifest digests -----------------------------------------------------------------------

    def record_manifest(self, version: int, sha256: str) -> None:
        self.client.hset(self._prefix + "manifests", str(version), sha256)

    def manifest_sha256(self, version: int) -> str | None:
        value = self.client.hget(self._prefix + "manifests", str(version))
        return None if value is None else value.decode()

    def forget_manifests(self, versions: Iterable[int]) -> None:
        fields = [str(v) for v in versions]
        if fields:
            self.client.hdel(self._prefix + "manifests", *fields)

    def recorded_versions(self) -> list[int]:
        return sorted(int(v) for v in self.client.hkeys(self._prefix + "manifests"))

    # holders --------------------------------------------------------------------------------

    def _holders_key(self, version: int) -> str:
        return f"{self._prefix}holders:{version}"

    def holders(self, version: int) -> list[str]:
        """Base URLs of the live servers that hold `version`."""
        return [url.decode() for url in self._live(keys=[self._holders_key(version)])]

    def hold(self, version: int, url: str) -> None:
        """Announce that `url` serves `version` (kept alive until `unhold` or `close`)."""
        self._add((self._holders_key(version), url))

    def unhold(self, version: int, url: str) -> None:
        self._remove((self._holders_key(version),), url)

    def _partial_keys(self, version: int) -> tuple[str, str]:
        return f"{self._prefix}partial:{version}", f"{self._prefix}have:{version}"

    def hold_chunks(self, version: int, url: str, held: bytes, fetching: bytes) -> None:
        """Announce that `url` serves the chunks of `version` set in `held` and is fetching those
        set in `fetching` (bitmaps of one length, `chunk_bitmap`); each call replaces the previous
        sets. Kept alive until `unhold_chunks` or `close`."""
        if len(held) != len(fetching):
            raise ValueError(f"bitmaps of {len(held)} and {len(fetching)} bytes: they must be of one length")
        partial, have = self._partial_keys(version)
        with self._lock:
            self._own[partial, url] = (partial, have)
            self._refresh(keys=[partial, have], args=[url, self.ttl_ms, held + fetching])

    def unhold_chunks(self, version: int, url: str) -> None:
        self._remove(self._partial_keys(version), url)

    def partial_holders(self, version: int) -> Mapping[str, PartialHolder]:
        """Live partial holders of `version`: base URL -> the chunks it serves and those it fetches."""
        live, values = self._live_bitmaps(keys=list(self._partial_keys(version)))
        return {
            url.decode(): PartialHolder(chunks_in(value[: len(value) // 2]), chunks_in(value[len(value) // 2 :]))
            for url, value in zip(live, values, strict=True)
            if value is not None
        }

    # pull leases ------------------------------------------------------------------------------

    def lease(self, version: int, owner: str) -> None:
        """Mark `version` as being pulled by `owner` (until `unlease` or `close`)."""
        self._add((self._prefix + "leases", f"{version}:{owner}"))

    def unlease(self, version: int, owner: str) -> None:
        self._remove((self._prefix + "leases",), f"{version}:{owner}")

    def leased_versions(self) -> set[int]:
        return {int(member.decode().split(":", 1)[0]) for member in self._live(keys=[self._prefix + "leases"])}

    # own entries ----------------------------------------------------------------------------

    # The lock also orders Redis writes: a refresh never re-adds an entry just removed.

    def _add(self, entry: tuple[str, str]) -> None:
        with self._lock:
            self._own[entry] = (entry[0],)
            self._refresh(keys=[entry[0]], args=[entry[1], self.ttl_ms])

    def _remove(self, keys: tuple[str, ...], member: str) -> None:
        with self._lock:
            self._own.pop((keys[0], member), None)
            self._delete(keys, member)

    def _delete(self, keys: tuple[str, ...], member: str) -> None:
        """Remove `member` from the sorted set `keys[0]` and its field from the hashes after it."""
        pipe = self.client.pipeline()
        pipe.zrem(keys[0], member)
        for hash_key in keys[1:]:
            pipe.hdel(hash_key, member)
        pipe.execute()

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                with self._lock:
                    for (_, member), keys in self._own.items():
                        self._refresh(keys=list(keys), args=[member, self.ttl_ms])
            except redis.RedisError as exc:
                log.warning("could not refresh weight holder/lease entries: %s", exc)

    def close(self) -> None:
        """Stop refreshing and remove this process's entries."""
        self._stop.set()
        self._heartbeat.join(timeout=5)
        with self._lock:
            entries, self._own = list(self._own.items()), {}
        for (_, member), keys in entries:
            try:
                self._delete(keys, member)
            except redis.RedisError as exc:
                log.warning("could not remove weight holder/lease entry %s: %s", member, exc)
