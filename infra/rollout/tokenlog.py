"""The durable token log (docs/internals.md §4): samples, leases, logged tokens, the per-step queues
and completed-group streaming, all in Redis.

This module owns the token log's Redis keys (their table: docs/internals.md §4) and every transition
of them. A sample (``"<step>/<group>/<index>"``) is ``queued -> running -> done``, goes back to
``queued`` on a release or a reap (keeping its logged tokens), or ends ``failed`` (its group is then
dropped). Every ownership-dependent transition is one Lua script in ``lua/``, fenced by the sample's
lease epoch, so a zombie never writes into a migrated sample; flushes carry offsets and claims a
nonce, so a retried call applies once. Everyone else reads the log through `TokenLog`'s methods,
never through its keys.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
import time
import zlib
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any, NamedTuple

import numpy as np
import redis
from redis.cluster import RedisCluster
from redis.typing import KeyT, StreamIdT

from infra.keyspace import current_step_key, glob_escape, tokenlog_prefix, tokenlog_shards_key
from infra.rollout.control import ROUTE_S
from rl.generation import GenerationRequest, SamplingParams

# --- keys read outside the Lua scripts (``P`` = a shard's `infra.keyspace.tokenlog_prefix`; all: docs/internals.md §4)


def _sample_key(prefix: str, sample_id: str) -> str:
    """``P s:<sample>``: hash of one sample's state, owner, epoch, budget, ..."""
    return f"{prefix}s:{sample_id}"


def _records_key(prefix: str, sample_id: str) -> str:
    """``P s:<sample>:r``: the sample's (token, logprob) records."""
    return f"{prefix}s:{sample_id}:r"


def _queue_key(prefix: str, step: int) -> str:
    """``P q:<step>``: zset of the step's queued samples (score < 0: with logged tokens)."""
    return f"{prefix}q:{step}"


def _owned_key(prefix: str, instance_id: str) -> str:
    """``P own:<instance>``: set of the samples the instance is running."""
    return f"{prefix}own:{instance_id}"


def _done_key(prefix: str, step: int) -> str:
    """``P done:<step>``: stream of the step's completed group ids."""
    return f"{prefix}done:{step}"


def _stats_key(prefix: str) -> str:
    """``P stats``: hash of the token log's counters."""
    return prefix + "stats"


_CLUSTER_WAIT_S = 0.05
"""On a cluster, how long `TokenLog.next_completed_groups` blocks on one shard's stream before it
looks at the others again (the most a completed group waits to be seen)."""

_STEP_KEY = r"(?:(?:step|groups|q|qr|done|dropped):{step}|(?:g|s):{step}/.*)"
"""What follows ``P`` in a key of step ``{step}`` (`TokenLog.step_keys`)."""

if array("I").itemsize != 4 or array("f").itemsize != 4:
    raise ImportError("the token log needs 4-byte array('I') and array('f')")
_SWAP = sys.byteorder == "big"


def _pack(typecode: str, values: Iterable[Any]) -> bytes:
    packed = array(typecode, values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


RECORD = np.dtype([("token", "<u4"), ("logprob", "<f4")])
"""One logged token: its id and its logprob, little-endian, 8 bytes."""


def _records(data: bytes | None) -> tuple[list[int], list[float]]:
    """Token ids and logprobs of a sample's packed records."""
    records = np.frombuffer(data or b"", dtype=RECORD)
    return records["token"].tolist(), records["logprob"].tolist()


def _unpack(typecode: str, data: bytes | None) -> list:
    packed = array(typecode)
    packed.frombytes(data or b"")
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


@dataclass(frozen=True)
class GroupSpec:
    """One prompt to sample `n` responses for."""

    group_id: int
    prompt_ids: Sequence[int]
    n: int
    max_new_tokens: int
    seed: int = 0
    sampling: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of `rl.engine.SamplingParams`."""
    meta: Mapping[str, Any] | None = None
    """What scoring needs (e.g. the answer); JSON-serialisable; returned by `read_group`."""

    def __post_init__(self) -> None:
        where = f"group {self.group_id}"
        if self.group_id < 0:
            raise ValueError(f"{where}: group_id must be >= 0")
        if not self.prompt_ids:
            raise ValueError(f"{where}: empty prompt")
        if self.n < 1:
            raise ValueError(f"{where}: n={self.n}, must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens={self.max_new_tokens}, must be >= 1")
        try:
            SamplingParams(**self.sampling)
        except TypeError as exc:
            raise ValueError(f"{where}: bad sampling parameters: {exc}") from None


@dataclass(frozen=True)
class Claim:
    """A sample leased to an instance: resume it from `generated_ids`."""

    sample_id: str
    epoch: int
    prompt_ids: list[int]
    generated_ids: list[int]
    """Response tokens logged so far (the prefix to re-prefill and continue)."""
    generated_logprobs: list[float]
    max_new_tokens: int
    """The total response budget, including `generated_ids`."""
    seed: int
    sampling: dict[str, Any]

    def request(self, stop_token_ids: tuple[int, ...] = ()) -> GenerationRequest:
        """The engine request that continues this sample."""
        return GenerationRequest(
            sample_id=self.sample_id,
            prompt_ids=self.prompt_ids,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed,
            sampling=SamplingParams(**self.sampling),
            generated_ids=list(self.generated_ids),
            stop_token_ids=stop_token_ids,
        )


class Flush(NamedTuple):
    """New tokens of one leased sample; with `finish_reason` it also completes the sample."""

    sample_id: str
    instance_id: str
    epoch: int
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    offset: int | None = None
    """Response tokens logged before these; makes a redelivered flush exactly-once."""
    finish_reason: str | None = None
    policy_version: int | None = None
    """The version that generated these tokens (recorded per span; refused below the step's window)."""


@dataclass(frozen=True)
class SampleRecord:
    sample_id: str
    group_id: int
    index: int
    state: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    attempts: int
    """Claims of this sample."""
    migrations: int
    """Claims that resumed it after another lease (attempts - 1)."""
    policy_version: int
    """The version the sample's step trains from (the proximal policy)."""
    meta: Mapping[str, Any] | None
    version_spans: tuple[tuple[int, int], ...] = ()
    """(first token, version) of each run of tokens one policy version generated, in order; empty
    when the flushes carried no version."""

    def token_versions(self) -> list[int]:
        """The generating version of each logged token (the step's version where none was recorded)."""
        return expand_spans(self.version_spans, len(self.token_ids), self.policy_version)


def expand_spans(spans: Sequence[Sequence[int]], length: int, default: int) -> list[int]:
    """Per-token versions of `length` tokens from (first token, version) spans; tokens before the
    first span (or all, without spans) get `default`."""
    versions = [default] * length
    for (start, version), following in zip(spans, [*spans[1:], (length, 0)]):
        versions[start : following[0]] = [version] * max(0, min(following[0], length) - start)
    return versions


def _spans(data: bytes | None) -> tuple[tuple[int, int], ...]:
    pairs = np.frombuffer(data or b"", dtype="<u4").reshape(-1, 2)
    return tuple((int(a), int(b)) for a, b in pairs)


@dataclass(frozen=True)
class StepStatus:
    step: int
    policy_version: int
    groups_total: int
    groups_done: int
    groups_dropped: int
    dropped_group_ids: tuple[int, ...]
    queued: int
    running: int
    done: int
    failed: int
    tokens_logged: int
    min_version: int = -1
    """The oldest version whose tokens the step accepts (its `policy_version` when strict)."""

    @property
    def complete(self) -> bool:
        """Every group is done or dropped: nothing left to generate."""
        return self.groups_done + self.groups_dropped == self.groups_total


@dataclass(frozen=True)
class TokenLogStats:
    rejected_appends: int
    """Flushes rejected by the fence (stale lease, wrong owner, over budget, unknown sample)."""
    wasted_tokens: int
    """Logged tokens discarded by `release(keep_tokens=False)`."""
    migrations: int
    failed_samples: int
    reaped_samples: int


class RunningLease(NamedTuple):
    """A running sample as `TokenLog.step_leases` reads it."""

    sample_id: str
    logged: int
    """Response tokens logged."""
    budget: int
    """Its response budget (max_new_tokens); 0 if the sample is gone."""


@dataclass(frozen=True)
class StepLeases:
    """One step's leases (`TokenLog.step_leases`)."""

    running: dict[str, list[RunningLease]]
    """Each instance asked about: its running samples of the step, by sample id."""
    queued_partial: int
    """The step's queued samples that have logged tokens."""


# --- Lua: one file per script in lua/, each run after lua/prelude.lua (docs/internals.md §4) -------

_SCRIPT_NAMES = (
    "enqueue",
    "claim",
    "log",
    "release",
    "fail",
    "release_all",
    "disown",
    "status",
    "read_group",
    "delete_step",
)


def _lua(name: str) -> str:
    return (resources.files("infra.rollout") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


_PRELUDE = _lua("prelude")
_SCRIPTS = {name: _lua(name) for name in _SCRIPT_NAMES}


def _text(value: bytes | None) -> str:
    return (value or b"").decode()


def _str(reply: bytes | str) -> str:
    """A reply of the binary client as text."""
    return reply.decode() if isinstance(reply, bytes) else reply


class ShardCountMismatch(ValueError):
    """The run's token log has another shard count than the one configured (`fabric.tokenlog_shards`)."""


class TokenLog:
    """One run's token log on a Redis server or cluster; stateless apart from stream cursors, so any
    number of TokenLog objects (in any processes) on the same Redis and run id see one state.

    Its keys are spread over `shards` hash tags (`infra.keyspace.tokenlog_prefix`; docs/internals.md
    §4): a group and its samples live in shard ``group_id % shards``, each shard has its own queues,
    step hashes, done streams, stats and per-instance owned sets, and every script touches one shard
    (one slot of a cluster). The run's driver gives `shards` (`fabric.tokenlog_shards`), which is
    recorded for the run and refused if it differs from the recorded count; everyone else leaves it
    None and reads it on first use (absent: 1, the layout of a run that predates shards).
    """

    def __init__(self, client: redis.Redis, run_id: str, shards: int | None = None) -> None:
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("TokenLog needs a Redis client with decode_responses=False (it stores binary arrays)")
        if not run_id or any(c in run_id for c in "{}") or not run_id.isprintable():
            raise ValueError(f"run_id must be non-empty, printable, without braces: {run_id!r}")
        self.client = client
        self.run_id = run_id
        self._shards = None if shards is None else self._record_shards(shards)
        self._prefixes: list[str] = []
        self._stats: list[str] = []
        self._scripts = {name: client.register_script(_PRELUDE + body) for name, body in _SCRIPTS.items()}
        self._cursors: dict[str, bytes] = {}
        """Done stream key -> the last of its entries this object returned."""
        self._cluster = isinstance(client, RedisCluster)

    @property
    def shards(self) -> int:
        """The run's shard count: as given, else read from Redis on first use."""
        if self._shards is None:
            stored = self.client.get(tokenlog_shards_key(self.run_id))
            self._shards = 1 if stored is None else int(stored)
        return self._shards

    @property
    def prefixes(self) -> list[str]:
        """Each shard's key prefix (``P`` of its keys)."""
        if not self._prefixes:
            self._prefixes = [tokenlog_prefix(self.run_id, shard, self.shards) for shard in range(self.shards)]
            self._stats = [_stats_key(prefix) for prefix in self._prefixes]
        return self._prefixes

    @property
    def prefix(self) -> str:
        """Shard 0's prefix (the run's own, ``rlb:{R}:``, with one shard)."""
        return self.prefixes[0]

    def _record_shards(self, shards: int) -> int:
        """Record the run's count, or check it against the recorded one."""
        key = tokenlog_shards_key(self.run_id)
        if shards < 1:
            raise ValueError(f"the token log needs at least one shard, got {shards}")
        if self.client.set(key, shards, nx=True):
            if shards > 1 and self.client.exists(current_step_key(self.run_id)):  # a run from before shards
                self.client.delete(key)
                raise ShardCountMismatch(
                    f"run {self.run_id!r}'s token log has 1 shard, not {shards}: "
                    "set fabric.tokenlog_shards to 1 to resume it"
                )
            return shards
        stored = int(self.client.get(key) or shards)
        if stored != shards:
            raise ShardCountMismatch(
                f"run {self.run_id!r}'s token log has {stored} shards, not {shards}: "
                f"set fabric.tokenlog_shards to {stored} to resume it"
            )
        return shards

    def _run(self, script: str, shard: int, *args: Any) -> Any:
        prefix = self.prefixes[shard]
        return self._scripts[script](keys=[self._stats[shard]], args=[prefix, *args])

    def shard_of(self, sample_id: str) -> int:
        """The shard of a sample (its group's: ``"<step>/<group>/<index>"``); 0 for a malformed id."""
        if self.shards == 1:
            return 0
        parts = sample_id.split("/")
        return int(parts[1]) % self.shards if len(parts) == 3 and parts[1].isdigit() else 0

    def _shard_order(self, instance_id: str) -> list[int]:
        """The shards an instance claims from, in order: from one its id picks, then the next ones."""
        start = zlib.crc32(instance_id.encode()) % self.shards
        return [(start + offset) % self.shards for offset in range(self.shards)]

    def _sample_key(self, sample_id: str) -> str:
        return _sample_key(self.prefixes[self.shard_of(sample_id)], sample_id)

    # --- work in -------------------------------------------------------------------------------

    def enqueue_step(
        self, step: int, policy_version: int, groups: Sequence[GroupSpec], min_version: int | None = None
    ) -> bool:
        """Queue n samples per group for `step`, trained from `policy_version`, whose tokens any
        version in [`min_version`, `policy_version`] may generate (default: exactly that version);
        False (and nothing changes) if the step exists. Each shard gets its groups (maybe none),
        shard 0 last: the step exists once shard 0 has it, and a retry completes a partial enqueue."""
        if not groups:
            raise ValueError(f"step {step}: no groups to enqueue")
        ids = [g.group_id for g in groups]
        if len(set(ids)) != len(ids):
            raise ValueError(f"step {step}: duplicate group ids")
        min_version = policy_version if min_version is None else min_version
        if not 0 <= min_version <= policy_version:
            raise ValueError(f"step {step}: min_version {min_version} outside [0, {policy_version}]")
        created = False
        for shard in reversed(range(self.shards)):
            args: list[Any] = [step, policy_version, min_version]
            for g in groups:
                if g.group_id % self.shards == shard:
                    args += [
                        g.group_id,
                        g.n,
                        _pack("I", g.prompt_ids),
                        g.max_new_tokens,
                        g.seed,
                        json.dumps(dict(g.sampling)),
                        json.dumps(g.meta),
                    ]
            created = bool(self._run("enqueue", shard, *args))
        return created

    # --- the owner's side ----------------------------------------------------------------------

    def claim(self, step: int | Sequence[int], instance_id: str, policy_version: int, max_samples: int) -> list[Claim]:
        """Lease up to `max_samples` queued samples of `step` (or of several steps, oldest first
        within a shard), partially generated ones first within a step; from the instance's first
        shard, then the next ones while it wants more.

        A step gives nothing to a `policy_version` outside its window (exactly its version when
        strict; [min_version, version] with bounded staleness).
        """
        if max_samples < 1:
            return []
        steps = ",".join(str(s) for s in ([step] if isinstance(step, int) else step))
        nonce = secrets.token_hex(8)  # a shard's retried call returns what it leased, once
        rows: list = []
        for shard in self._shard_order(instance_id):
            rows += self._run("claim", shard, steps, instance_id, policy_version, max_samples - len(rows), nonce)
            if len(rows) >= max_samples:
                break
        return [
            Claim(
                sample_id=sid.decode(),
                epoch=int(epoch),
                prompt_ids=_unpack("I", prompt),
                generated_ids=token_ids,
                generated_logprobs=logprobs,
                max_new_tokens=int(max_new),
                seed=int(seed),
                sampling=json.loads(sampling),
            )
            for sid, epoch, prompt, records, max_new, seed, sampling in rows
            for token_ids, logprobs in [_records(records)]
        ]

    def log(self, flushes: Iterable[Flush | tuple]) -> list[bool]:
        """Apply many flushes in one round trip per shard they touch; each is accepted iff its
        lease is current (state running, same owner, same epoch), it fits the budget and, with
        `offset`, starts where the logged tokens end. A finishing flush marks the sample done; the
        group streams to the trainer when its last sample is done. Rejections count in
        `rejected_appends`."""
        batches: dict[int, tuple[list[tuple], list[int], list[float], list[int]]] = {}
        count = 0
        for entry in flushes:
            f = entry if isinstance(entry, Flush) else Flush(*entry)
            k = len(f.token_ids)
            if k != len(f.logprobs):
                raise ValueError(f"sample {f.sample_id}: {k} tokens but {len(f.logprobs)} logprobs")
            if f.finish_reason == "":
                raise ValueError(f"sample {f.sample_id}: empty finish_reason (use None)")
            meta, tokens, logprobs, positions = batches.setdefault(self.shard_of(f.sample_id), ([], [], [], []))
            meta.append(
                (
                    f.sample_id,
                    f.instance_id,
                    f.epoch,
                    -1 if f.offset is None else f.offset,
                    k,
                    f.finish_reason or "",
                    -1 if f.policy_version is None else f.policy_version,
                )
            )
            tokens.extend(f.token_ids)
            logprobs.extend(f.logprobs)
            positions.append(count)
            count += 1
        accepted = [False] * count
        for shard, (meta, tokens, logprobs, positions) in batches.items():
            records = np.empty(len(tokens), dtype=RECORD)
            records["token"] = tokens
            records["logprob"] = logprobs
            reply = self._run("log", shard, json.dumps(meta), records.tobytes())
            for position, ok in zip(positions, reply):
                accepted[position] = bool(ok)
        return accepted

    def append(
        self,
        sample_id: str,
        instance_id: str,
        epoch: int,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        *,
        offset: int | None = None,
    ) -> bool:
        return self.log([Flush(sample_id, instance_id, epoch, token_ids, logprobs, offset)])[0]

    def finish(
        self,
        sample_id: str,
        instance_id: str,
        epoch: int,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        finish_reason: str,
        *,
        offset: int | None = None,
    ) -> bool:
        flush = Flush(sample_id, instance_id, epoch, token_ids, logprobs, offset, finish_reason)
        return self.log([flush])[0]

    def release(
        self,
        sample_id: str,
        instance_id: str,
        epoch: int,
        *,
        keep_tokens: bool = True,
        to: str | None = None,
        route_s: float = ROUTE_S,
    ) -> bool:
        """Give a leased sample back to the queue (False if the lease is not current).

        keep_tokens=False discards its logged tokens (counted in `wasted_tokens`): the
        restart-from-scratch baseline. With `to` (a steal's receiver) the sample waits in the
        step's routed queue, where only instance `to` may claim it for `route_s` seconds of the
        Redis server's clock; then any instance may (the receiver died or stopped claiming).
        """
        if to is not None and (not to or route_s <= 0):
            raise ValueError(f"sample {sample_id}: route to a non-empty instance id for route_s > 0")
        route_ms = round(route_s * 1000)
        shard = self.shard_of(sample_id)
        return bool(self._run("release", shard, sample_id, instance_id, epoch, int(keep_tokens), to or "", route_ms))

    def fail(self, sample_id: str, instance_id: str, epoch: int, reason: str) -> bool:
        """Mark a leased sample failed (the engine cannot generate it); its group is dropped."""
        return bool(self._run("fail", self.shard_of(sample_id), sample_id, instance_id, epoch, reason))

    def disown(self, instance_id: str, held: Iterable[str]) -> int:
        """Requeue (tokens kept) every sample the token log says the instance runs that it does not
        hold: what a Redis that lost its last writes (an append-only file fsynced once a second)
        remembers of a finish or a flush the instance already had acknowledged. Returns how many."""
        kept = sorted(held)
        return sum(
            int(self._run("disown", shard, instance_id, *(s for s in kept if self.shard_of(s) == shard)))
            for shard in range(self.shards)
        )

    # --- the controller's side -----------------------------------------------------------------

    def release_all(self, instance_id: str) -> int:
        """Requeue every sample the (live) instance runs, tokens kept; returns how many."""
        # not a reap: no max_reaps
        return sum(int(self._run("release_all", shard, instance_id, 0, 0)) for shard in range(self.shards))

    def reap(self, instance_id: str, max_reaps: int) -> int:
        """Requeue every sample of a dead instance (its epochs bump, fencing the zombie); a
        sample reaped `max_reaps` times (`controller.max_reaps`) fails instead. Returns how many
        samples were taken."""
        if max_reaps < 1:
            raise ValueError(f"max_reaps must be >= 1, got {max_reaps}")
        return sum(int(self._run("release_all", shard, instance_id, 1, max_reaps)) for shard in range(self.shards))

    def owners(self) -> set[str]:
        """Every instance that runs at least one sample of this run (one SCAN of every shard's ``own:*``)."""
        if self.shards == 1:
            start = len(_owned_key(self.prefix, ""))
            match = f"{glob_escape(self.prefix)}own:*"
            return {_str(key)[start:] for key in self.client.scan_iter(match=match, count=1000)}
        match = glob_escape(f"rlb:{{{self.run_id}/") + "*" + glob_escape("}:own:") + "*"
        return {_str(key).split("}:own:", 1)[1] for key in self.client.scan_iter(match=match, count=1000)}

    def _owned(self, pipe: Any, instance_id: str) -> None:
        for prefix in self.prefixes:
            pipe.smembers(_owned_key(prefix, instance_id))

    def _queued_partial(self, pipe: Any, step: int) -> None:
        for prefix in self.prefixes:
            pipe.zcount(_queue_key(prefix, step), "-inf", "(0")  # scores < 0: logged tokens

    def step_leases(self, step: int, instance_ids: Sequence[str]) -> StepLeases:
        """Each instance's running samples of `step` (logged tokens, budget) and how many of the
        step's queued samples have logged tokens: two round trips (pipelines), however many
        instances."""
        pipe = self.client.pipeline(transaction=False)
        for instance_id in instance_ids:
            self._owned(pipe, instance_id)
        self._queued_partial(pipe, step)
        replies = pipe.execute()
        n = self.shards
        owned = [set().union(*replies[i * n : (i + 1) * n]) for i in range(len(instance_ids))]
        queued_partial = sum(int(count) for count in replies[len(instance_ids) * n :])
        mine = f"{step}/"
        running = [sorted(s for s in (m.decode() for m in members) if s.startswith(mine)) for members in owned]
        pipe = self.client.pipeline(transaction=False)
        for sid in (s for sids in running for s in sids):
            shard_prefix = self.prefixes[self.shard_of(sid)]
            pipe.hget(_sample_key(shard_prefix, sid), "max_new")
            pipe.strlen(_records_key(shard_prefix, sid))
        replies = iter(pipe.execute())
        leases: dict[str, list[RunningLease]] = {}
        for instance_id, sids in zip(instance_ids, running):
            leases[instance_id] = []
            for sid in sids:
                budget, nbytes = next(replies), next(replies)
                leases[instance_id].append(RunningLease(sid, nbytes // RECORD.itemsize, int(budget or 0)))
        return StepLeases(leases, queued_partial)

    def queued_partial(self, step: int) -> int:
        """The step's queued samples that have logged tokens."""
        pipe = self.client.pipeline(transaction=False)
        self._queued_partial(pipe, step)
        return sum(int(count) for count in pipe.execute())

    def running(self, instance_id: str) -> set[str]:
        """The samples, of any step, the token log has the instance running."""
        pipe = self.client.pipeline(transaction=False)
        self._owned(pipe, instance_id)
        return {_str(m) for members in pipe.execute() for m in members}

    def sample_owners(self, sample_ids: Sequence[str]) -> list[str]:
        """Each sample's owner ('' once released, or for an unknown sample), in one round trip;
        a done sample keeps the owner whose flush finished it."""
        pipe = self.client.pipeline(transaction=False)
        for sid in sample_ids:
            pipe.hget(self._sample_key(sid), "owner")
        return [(owner or b"").decode() for owner in pipe.execute()]

    # --- the trainer's side --------------------------------------------------------------------

    def next_completed_groups(self, step: int, timeout_s: float = 0.0) -> list[int]:
        """Groups of `step` completed since the last call on this object (from the start for a
        new object), waiting up to `timeout_s` for one when there are none. Never pops: a
        restarted trainer replays them. The client's socket_timeout must exceed `timeout_s`.

        One XREAD of every shard's done stream; on a cluster (which refuses a read across slots)
        one per shard, waiting on each in turn for at most `_CLUSTER_WAIT_S`."""
        keys = [_done_key(prefix, step) for prefix in self.prefixes]
        if not self._cluster or self.shards == 1:
            block = max(1, int(timeout_s * 1000)) if timeout_s > 0 else None
            return self._completed(self.client.xread(self._streams(keys), block=block))
        deadline = time.monotonic() + timeout_s
        turn = 0
        while True:
            groups = [g for key in keys for g in self._completed(self.client.xread(self._streams([key])))]
            remaining = deadline - time.monotonic()
            if groups or remaining <= 0:
                return groups
            key = keys[turn % len(keys)]
            turn += 1
            block = max(1, int(min(remaining, _CLUSTER_WAIT_S) * 1000))
            groups = self._completed(self.client.xread(self._streams([key]), block=block))
            if groups:
                return groups

    def _streams(self, keys: Sequence[str]) -> dict[KeyT, StreamIdT]:
        """XREAD's streams argument: each done stream of `keys` from this object's cursor."""
        return {key: self._cursors.get(key, b"0") for key in keys}

    def _completed(self, reply: Any) -> list[int]:
        """The group ids of an XREAD reply, moving the cursors of the streams it read."""
        if isinstance(reply, dict):
            raise TypeError("the token log needs a RESP2 client (replies as lists)")
        groups: list[int] = []
        for key, entries in reply or []:
            if entries:
                self._cursors[_str(key)] = entries[-1][0]
                groups += [int(fields[b"g"]) for _, fields in entries]
        return groups

    def completions(self, step: int) -> int:
        """Entries of the step's completed-group streams: each complete group once."""
        pipe = self.client.pipeline(transaction=False)
        for prefix in self.prefixes:
            pipe.xlen(_done_key(prefix, step))
        return sum(int(length) for length in pipe.execute())

    def read_group(self, step: int, group_id: int) -> list[SampleRecord]:
        """Every sample of a group, by index (a consistent snapshot)."""
        reply = self._run("read_group", group_id % self.shards, step, group_id)
        if reply is None:
            raise KeyError(f"no group {group_id} in step {step} of run {self.run_id!r}")
        version, prompt, meta, *samples = reply
        prompt_ids = _unpack("I", prompt)
        meta = json.loads(meta)
        return [
            SampleRecord(
                sample_id=f"{step}/{group_id}/{index}",
                group_id=group_id,
                index=index,
                state=state.decode(),
                prompt_ids=prompt_ids,
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=_text(finish) or None,
                attempts=int(attempts),
                migrations=int(migrations),
                policy_version=int(version),
                meta=meta,
                version_spans=_spans(spans),
            )
            for index, (state, finish, attempts, migrations, records, spans) in enumerate(samples)
            for token_ids, logprobs in [_records(records)]
        ]

    def step_status(self, step: int) -> StepStatus:
        """The step's counts over every shard (one script each)."""
        replies = [self._run("status", shard, step) for shard in range(self.shards)]
        if replies[0] is None:
            raise KeyError(f"no step {step} in run {self.run_id!r}")
        version, min_version = replies[0][0], replies[0][10]
        present = [reply for reply in replies if reply is not None]
        groups, done, dropped, queued, running, sdone, failed, tokens = (
            sum(int(reply[i]) for reply in present) for i in range(1, 9)
        )
        return StepStatus(
            step=step,
            policy_version=int(version),
            groups_total=groups,
            groups_done=done,
            groups_dropped=dropped,
            dropped_group_ids=tuple(sorted(int(g) for reply in present for g in reply[9])),
            queued=queued,
            running=running,
            done=sdone,
            failed=failed,
            tokens_logged=tokens,
            min_version=int(min_version),
        )

    def stats(self) -> TokenLogStats:
        """The counters, summed over the shards."""
        pipe = self.client.pipeline(transaction=False)
        for prefix in self.prefixes:
            pipe.hgetall(_stats_key(prefix))
        shards = pipe.execute()
        return TokenLogStats(
            **{f.name: sum(int(values.get(f.name.encode(), 0)) for values in shards) for f in fields(TokenLogStats)}
        )

    def delete_step(self, step: int) -> bool:
        """Free a trained step's keys (its samples' leases end); False if there was no step. Shard 0
        goes last: the step exists while it has it, and a retry finishes a partial delete."""
        for prefix in self.prefixes:
            self._cursors.pop(_done_key(prefix, step), None)
        deleted = [bool(self._run("delete_step", shard, step)) for shard in reversed(range(self.shards))]
        return any(deleted)

    def step_keys(self, step: int) -> list[str]:
        """The keys of `step` still in Redis, sorted (a SCAN per shard; none once `delete_step` freed them)."""
        found: list[str] = []
        for prefix in self.prefixes:
            own = re.compile(re.escape(prefix) + _STEP_KEY.format(step=step))
            keys = (_str(k) for k in self.client.scan_iter(match=f"{glob_escape(prefix)}*:{step}*", count=1000))
            found += (k for k in keys if own.fullmatch(k))
        return sorted(found)
