"""The durable token log (docs/internals.md §4): samples, leases, logged tokens, the per-step queue and
completed-group streaming, all in Redis.

This module owns the Redis state of rollout work and every transition of it. A **sample** is one
response to one prompt (id ``"<step>/<group>/<index>"``, as in `rl.rollout`); a **group** is the
n samples of a prompt. A sample is ``queued -> running -> done`` and may go back to ``queued``
(release, reap) any number of times, keeping its logged tokens; ``failed`` is terminal.

Every transition that depends on ownership is one Lua script, fenced by the sample's **lease
epoch**: a claim bumps the epoch and hands it to the new owner, a release or reap bumps it again,
and an append, finish, release or fail whose (owner, epoch) is not current is rejected. So a
zombie (an owner whose lease was revoked) can never write into a migrated sample.

Flushes are exactly-once under the client's automatic retries when they carry `offset` (the
number of response tokens the caller believes are already logged): a redelivered flush that was
applied is recognised and acknowledged, a stale one rejected. Claims carry a nonce, so a
redelivered claim returns the samples it already took instead of taking more.

A flush costs the server two commands per sample: the lease check (HMGET) and one APPEND of the
sample's (token, logprob) records, whose reply (the new length) is then checked against the offset
and the budget; a flush that does not fit is undone inside the same script, so no one ever sees it.

Failure policy: a sample whose owner has been reaped (declared dead) `max_reaps` times is marked
``failed`` (it may be what crashes instances); voluntary releases never fail a sample. An owner
may also `fail` a sample it cannot generate. A group with a failed sample is **dropped**: it never
streams to the trainer and is reported in `StepStatus.dropped_group_ids`.

Key layout (``P = "rlb:{<run_id>}:"``; the hash tag keeps a run in one cluster slot):

===========================  ==========================================================
``P stats``                  hash: rejected_appends, wasted_tokens, migrations,
                             failed_samples, reaped_samples
``P step:<step>``            hash: version (trained from), minv (oldest version it accepts),
                             groups, groups_done, groups_dropped, seq
``P groups:<step>``          list of group ids, in enqueue order
``P g:<step>/<group>``       hash: n, done, failed, prompt (packed u32), max_new, seed,
                             sampling (JSON), meta (JSON)
``P s:<sample>``             hash: state, owner, epoch, attempts, migrations, reaps, finish,
                             step, group, max_new, minv, lastv (version of the last
                             span); to, to_until while in ``qr``
``P s:<sample>:r``           string: the generated tokens, one 8-byte record each (token id u32 LE,
                             logprob f32 LE), APPENDed
``P s:<sample>:v``           string: version spans, 8 bytes each (first token u32 LE, version
                             u32 LE), one per change of the generating version
``P q:<step>``               zset of queued samples; score = seq - logged_tokens * 2^32
                             (more logged tokens first, then enqueue order)
``P qr:<step>``              zset of queued samples routed to one instance (a steal's
                             receiver, the sample's ``to``) until ``to_until`` (server ms);
                             same scores; claimed before ``q``, by anyone once expired
``P done:<step>``            stream of completed group ids (field ``g``)
``P dropped:<step>``         set of dropped group ids
``P own:<instance>``         set of the samples the instance is running
``P claimreq:<instance>``    hash: nonce and sample ids of the instance's last claim
===========================  ==========================================================
"""

from __future__ import annotations

import json
import secrets
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import numpy as np
import redis

from infra.keyspace import done_key, owned_key, run_prefix, stats_key
from rl.generation import GenerationRequest, SamplingParams

STATES = ("queued", "running", "done", "failed")

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


def _glob_escape(text: str) -> str:
    """`text` as a literal inside a Redis MATCH pattern."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


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


# --- Lua -----------------------------------------------------------------------------------------
# Every script gets KEYS[1] = the run's stats key (routes a cluster client to the run's slot) and
# ARGV[1] = the run's key prefix.

_PRELUDE = """
local P = ARGV[1]
local STATS = KEYS[1]

-- a sample of (step, group) became `field` ('done' or 'failed'): complete or drop the group
local function settle(step, group, field)
  local gk = P .. 'g:' .. step .. '/' .. group
  redis.call('HINCRBY', gk, field, 1)
  local g = redis.call('HMGET', gk, 'n', 'done', 'failed')
  local done, failed = tonumber(g[2]), tonumber(g[3])
  if done + failed == tonumber(g[1]) then
    if failed == 0 then
      redis.call('XADD', P .. 'done:' .. step, '*', 'g', group)
      redis.call('HINCRBY', P .. 'step:' .. step, 'groups_done', 1)
    else
      redis.call('SADD', P .. 'dropped:' .. step, group)
      redis.call('HINCRBY', P .. 'step:' .. step, 'groups_dropped', 1)
    end
  end
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- revoke the lease of a running sample and queue it again, keeping or discarding its tokens;
-- with `to`, in the step's routed queue: only `to` may claim it until `until_ms`
local function requeue(sid, sk, step, keep, to, until_ms)
  redis.call('HINCRBY', sk, 'epoch', 1)
  redis.call('HSET', sk, 'state', 'queued', 'owner', '')
  local ntok = redis.call('STRLEN', sk .. ':r') / 8
  if not keep and ntok > 0 then
    redis.call('HINCRBY', STATS, 'wasted_tokens', ntok)
    redis.call('DEL', sk .. ':r', sk .. ':v')
    redis.call('HSET', sk, 'lastv', '')
    ntok = 0
  end
  local seq = redis.call('HINCRBY', P .. 'step:' .. step, 'seq', 1)
  if to and to ~= '' then
    redis.call('HSET', sk, 'to', to, 'to_until', until_ms)
    redis.call('ZADD', P .. 'qr:' .. step, seq - ntok * 4294967296, sid)
  else
    redis.call('ZADD', P .. 'q:' .. step, seq - ntok * 4294967296, sid)
  end
end

local function fail(sk, step, group, reason)
  redis.call('HINCRBY', sk, 'epoch', 1)
  redis.call('HSET', sk, 'state', 'failed', 'finish', reason)
  redis.call('HINCRBY', STATS, 'failed_samples', 1)
  settle(step, group, 'failed')
end
"""

# ARGV: P, step, version, min version, then per group: id, n, prompt, max_new, seed, sampling, meta
_ENQUEUE = """
local step = ARGV[2]
local stk = P .. 'step:' .. step
if redis.call('EXISTS', stk) == 1 then return 0 end
local seq, groups = 0, 0
for i = 5, #ARGV, 7 do
  local gid, n, max_new = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 3]
  redis.call('HSET', P .. 'g:' .. step .. '/' .. gid, 'n', n, 'done', 0, 'failed', 0,
    'prompt', ARGV[i + 2], 'max_new', max_new, 'seed', ARGV[i + 4], 'sampling', ARGV[i + 5],
    'meta', ARGV[i + 6])
  redis.call('RPUSH', P .. 'groups:' .. step, gid)
  for j = 0, n - 1 do
    local sid = step .. '/' .. gid .. '/' .. j
    redis.call('HSET', P .. 's:' .. sid, 'state', 'queued', 'owner', '', 'epoch', 0,
      'attempts', 0, 'migrations', 0, 'reaps', 0, 'finish', '', 'step', step, 'group', gid,
      'max_new', max_new, 'minv', ARGV[4], 'lastv', '')
    seq = seq + 1
    redis.call('ZADD', P .. 'q:' .. step, seq, sid)
  end
  groups = groups + 1
end
redis.call('HSET', stk, 'version', ARGV[3], 'minv', ARGV[4], 'groups', groups, 'groups_done', 0,
  'groups_dropped', 0, 'seq', seq)
return 1
"""

# ARGV: P, steps (comma-separated, oldest first), instance, version, max_samples, nonce. A step
# whose version window [minv, version] holds the instance's version gives its samples routed to the
# instance (and routed ones whose wait is over) first, then its shared queue's; then the next step.
_CLAIM = """
local inst = ARGV[3]
local ck = P .. 'claimreq:' .. inst
local last = redis.call('HMGET', ck, 'nonce', 'sids')
local sids
local function lease(sid)
  local sk = P .. 's:' .. sid
  if redis.call('HINCRBY', sk, 'attempts', 1) > 1 then
    redis.call('HINCRBY', sk, 'migrations', 1)
    redis.call('HINCRBY', STATS, 'migrations', 1)
  end
  redis.call('HINCRBY', sk, 'epoch', 1)
  redis.call('HSET', sk, 'state', 'running', 'owner', inst)
  redis.call('SADD', P .. 'own:' .. inst, sid)
  sids[#sids + 1] = sid
end
if last[1] == ARGV[6] then
  sids = cjson.decode(last[2])
else
  sids = {}
  local want, version = tonumber(ARGV[5]), tonumber(ARGV[4])
  for step in string.gmatch(ARGV[2], '[^,]+') do
    if #sids >= want then break end
    local w = redis.call('HMGET', P .. 'step:' .. step, 'version', 'minv')
    if w[1] and tonumber(w[2] or w[1]) <= version and version <= tonumber(w[1]) then
      local qr = P .. 'qr:' .. step
      local routed = redis.call('ZRANGE', qr, 0, -1)
      local now = #routed > 0 and now_ms() or 0
      for _, sid in ipairs(routed) do
        if #sids >= want then break end
        local sk = P .. 's:' .. sid
        local r = redis.call('HMGET', sk, 'to', 'to_until')
        if r[1] == inst or now >= tonumber(r[2] or 0) then
          redis.call('ZREM', qr, sid)
          redis.call('HDEL', sk, 'to', 'to_until')
          lease(sid)
        end
      end
      if #sids < want then
        local popped = redis.call('ZPOPMIN', P .. 'q:' .. step, want - #sids)
        for j = 1, #popped, 2 do lease(popped[j]) end
      end
    end
  end
  redis.call('HSET', ck, 'nonce', ARGV[6], 'sids', cjson.encode(sids))
end
local out = {}
for _, sid in ipairs(sids) do
  local sk = P .. 's:' .. sid
  local h = redis.call('HMGET', sk, 'state', 'owner', 'epoch', 'step', 'group')
  if h[1] == 'running' and h[2] == inst then
    local g = redis.call('HMGET', P .. 'g:' .. h[4] .. '/' .. h[5],
      'prompt', 'max_new', 'seed', 'sampling')
    out[#out + 1] = {sid, h[3], g[1], redis.call('GET', sk .. ':r') or '', g[2], g[3], g[4]}
  end
end
return out
"""

# ARGV: P, JSON [[sample, instance, epoch, offset (-1 = none), token count, finish reason
# ('' = none), policy version (-1 = none)], ...], every flush's records (8 bytes each) concatenated.
# A flush whose version is below the sample's window (`minv`) is rejected; an accepted one whose
# version differs from the sample's last opens a version span (u32 offset, u32 version) in :v.
_LOG = """
local recs = ARGV[3]
local out, rejected, pos = {}, 0, 1
for _, m in ipairs(cjson.decode(ARGV[2])) do
  local sid, inst, epoch, offset, k, fin, ver = m[1], m[2], m[3], m[4], m[5], m[6], m[7]
  local rec = string.sub(recs, pos, pos + 8 * k - 1)
  pos = pos + 8 * k
  local sk = P .. 's:' .. sid
  local rk = sk .. ':r'
  local h = redis.call('HMGET', sk, 'state', 'owner', 'epoch', 'max_new', 'minv', 'lastv')
  local ok = 0
  if h[2] == inst and tonumber(h[3]) == epoch and (ver < 0 or ver >= tonumber(h[5] or 0)) then
    if h[1] == 'running' then
      -- Append first (APPEND returns the new length), then check; undo what does not fit.
      local len = redis.call('APPEND', rk, rec)
      local have = len / 8 - k
      if (offset < 0 or offset == have) and len / 8 <= tonumber(h[4]) then
        if ver >= 0 and k > 0 and h[6] ~= tostring(ver) then
          redis.call('APPEND', sk .. ':v', struct.pack('<I4I4', have, ver))
          redis.call('HSET', sk, 'lastv', ver)
        end
        if fin ~= '' then
          redis.call('HSET', sk, 'state', 'done', 'finish', fin)
          redis.call('SREM', P .. 'own:' .. inst, sid)
          local g = redis.call('HMGET', sk, 'step', 'group')
          settle(g[1], g[2], 'done')
        end
        ok = 1
      else
        if k > 0 then
          if have == 0 then redis.call('DEL', rk)
          else redis.call('SET', rk, redis.call('GETRANGE', rk, 0, 8 * have - 1)) end
        end
        if offset >= 0 and offset + k == have and fin == ''
            and redis.call('GETRANGE', rk, offset * 8, -1) == rec then
          ok = 1  -- a redelivery of a flush that was already applied
        end
      end
    elseif h[1] == 'done' and offset >= 0 and offset + k == redis.call('STRLEN', rk) / 8
        and fin == redis.call('HGET', sk, 'finish') and redis.call('GETRANGE', rk, offset * 8, -1) == rec then
      ok = 1  -- a redelivery of the finishing flush
    end
  end
  if ok == 0 then rejected = rejected + 1 end
  out[#out + 1] = ok
end
if rejected > 0 then redis.call('HINCRBY', STATS, 'rejected_appends', rejected) end
return out
"""

# ARGV: P, sample, instance, epoch, keep tokens ('1'/'0'), route to ('' = the shared queue),
# route ms
_RELEASE = """
local sid, inst, to = ARGV[2], ARGV[3], ARGV[6]
local sk = P .. 's:' .. sid
local h = redis.call('HMGET', sk, 'state', 'owner', 'epoch', 'step')
if h[1] ~= 'running' or h[2] ~= inst or h[3] ~= ARGV[4] then return 0 end
redis.call('SREM', P .. 'own:' .. inst, sid)
requeue(sid, sk, h[4], ARGV[5] == '1', to, to ~= '' and now_ms() + tonumber(ARGV[7]) or 0)
return 1
"""

# ARGV: P, sample, instance, epoch, reason
_FAIL = """
local sid, inst = ARGV[2], ARGV[3]
local sk = P .. 's:' .. sid
local h = redis.call('HMGET', sk, 'state', 'owner', 'epoch', 'step', 'group')
if h[1] ~= 'running' or h[2] ~= inst or h[3] ~= ARGV[4] then return 0 end
redis.call('SREM', P .. 'own:' .. inst, sid)
fail(sk, h[4], h[5], ARGV[5])
return 1
"""

# ARGV: P, instance, reap ('1'/'0'), max reaps
_RELEASE_ALL = """
local inst, reap = ARGV[2], ARGV[3] == '1'
local own = P .. 'own:' .. inst
local count = 0
local sids = redis.call('SMEMBERS', own)
table.sort(sids)  -- requeue in a deterministic order
for _, sid in ipairs(sids) do
  local sk = P .. 's:' .. sid
  local h = redis.call('HMGET', sk, 'state', 'owner', 'step', 'group')
  if h[1] == 'running' and h[2] == inst then
    if reap and redis.call('HINCRBY', sk, 'reaps', 1) >= tonumber(ARGV[4]) then
      fail(sk, h[3], h[4], 'max_reaps')
    else
      requeue(sid, sk, h[3], true)
    end
    count = count + 1
  end
end
redis.call('DEL', own, P .. 'claimreq:' .. inst)
if reap and count > 0 then redis.call('HINCRBY', STATS, 'reaped_samples', count) end
return count
"""

# ARGV: P, instance, sample ids the instance holds...
_DISOWN = """
local inst = ARGV[2]
local own = P .. 'own:' .. inst
local keep = {}
for i = 3, #ARGV do keep[ARGV[i]] = true end
local count = 0
local sids = redis.call('SMEMBERS', own)
table.sort(sids)
for _, sid in ipairs(sids) do
  if not keep[sid] then
    local sk = P .. 's:' .. sid
    local h = redis.call('HMGET', sk, 'state', 'owner', 'step')
    if h[1] == 'running' and h[2] == inst then
      requeue(sid, sk, h[3], true)
      count = count + 1
    end
    redis.call('SREM', own, sid)
  end
end
return count
"""

# ARGV: P, step
_STATUS = """
local step = ARGV[2]
local s = redis.call('HMGET', P .. 'step:' .. step, 'version', 'groups', 'groups_done',
  'groups_dropped', 'minv')
if not s[1] then return false end
local counts = {queued = 0, running = 0, done = 0, failed = 0}
local tokens = 0
for _, gid in ipairs(redis.call('LRANGE', P .. 'groups:' .. step, 0, -1)) do
  local n = tonumber(redis.call('HGET', P .. 'g:' .. step .. '/' .. gid, 'n'))
  for j = 0, n - 1 do
    local sk = P .. 's:' .. step .. '/' .. gid .. '/' .. j
    local state = redis.call('HGET', sk, 'state')
    counts[state] = counts[state] + 1
    tokens = tokens + redis.call('STRLEN', sk .. ':r') / 8
  end
end
return {s[1], s[2], s[3], s[4], counts.queued, counts.running, counts.done, counts.failed,
  tokens, redis.call('SMEMBERS', P .. 'dropped:' .. step), s[5] or s[1]}
"""

# ARGV: P, step, group
_READ_GROUP = """
local base = ARGV[2] .. '/' .. ARGV[3]
local g = redis.call('HMGET', P .. 'g:' .. base, 'n', 'prompt', 'meta')
if not g[1] then return false end
local out = {redis.call('HGET', P .. 'step:' .. ARGV[2], 'version'), g[2], g[3]}
for j = 0, tonumber(g[1]) - 1 do
  local sk = P .. 's:' .. base .. '/' .. j
  local h = redis.call('HMGET', sk, 'state', 'finish', 'attempts', 'migrations')
  out[#out + 1] = {h[1], h[2], h[3], h[4], redis.call('GET', sk .. ':r') or '',
    redis.call('GET', sk .. ':v') or ''}
end
return out
"""

# ARGV: P, step
_DELETE_STEP = """
local step = ARGV[2]
if redis.call('EXISTS', P .. 'step:' .. step) == 0 then return 0 end
for _, gid in ipairs(redis.call('LRANGE', P .. 'groups:' .. step, 0, -1)) do
  local gk = P .. 'g:' .. step .. '/' .. gid
  for j = 0, tonumber(redis.call('HGET', gk, 'n')) - 1 do
    local sid = step .. '/' .. gid .. '/' .. j
    local sk = P .. 's:' .. sid
    local h = redis.call('HMGET', sk, 'state', 'owner')
    if h[1] == 'running' then redis.call('SREM', P .. 'own:' .. h[2], sid) end
    redis.call('DEL', sk, sk .. ':r', sk .. ':v')
  end
  redis.call('DEL', gk)
end
redis.call('DEL', P .. 'step:' .. step, P .. 'groups:' .. step, P .. 'q:' .. step,
  P .. 'qr:' .. step, P .. 'done:' .. step, P .. 'dropped:' .. step)
return 1
"""

_SCRIPTS = {
    "enqueue": _ENQUEUE,
    "claim": _CLAIM,
    "log": _LOG,
    "release": _RELEASE,
    "fail": _FAIL,
    "release_all": _RELEASE_ALL,
    "disown": _DISOWN,
    "status": _STATUS,
    "read_group": _READ_GROUP,
    "delete_step": _DELETE_STEP,
}


def _text(value: bytes | None) -> str:
    return (value or b"").decode()


class TokenLog:
    """One run's token log on a Redis server; stateless apart from stream cursors, so any number
    of TokenLog objects (in any processes) on the same Redis and run id see one state."""

    def __init__(self, client: redis.Redis, run_id: str, *, max_reaps: int = 10) -> None:
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("TokenLog needs a Redis client with decode_responses=False (it stores binary arrays)")
        if not run_id or any(c in run_id for c in "{}") or not run_id.isprintable():
            raise ValueError(f"run_id must be non-empty, printable, without braces: {run_id!r}")
        if max_reaps < 1:
            raise ValueError(f"max_reaps must be >= 1, got {max_reaps}")
        self.client = client
        self.run_id = run_id
        self.max_reaps = max_reaps
        self.prefix = run_prefix(run_id)
        self._stats_key = stats_key(run_id)
        self._scripts = {name: client.register_script(_PRELUDE + body) for name, body in _SCRIPTS.items()}
        self._cursors: dict[int, bytes] = {}

    def _run(self, script: str, *args: Any) -> Any:
        return self._scripts[script](keys=[self._stats_key], args=[self.prefix, *args])

    # --- work in -------------------------------------------------------------------------------

    def enqueue_step(
        self, step: int, policy_version: int, groups: Sequence[GroupSpec], min_version: int | None = None
    ) -> bool:
        """Queue n samples per group for `step`, trained from `policy_version`, whose tokens any
        version in [`min_version`, `policy_version`] may generate (default: exactly that version);
        False (and nothing changes) if the step exists."""
        if not groups:
            raise ValueError(f"step {step}: no groups to enqueue")
        ids = [g.group_id for g in groups]
        if len(set(ids)) != len(ids):
            raise ValueError(f"step {step}: duplicate group ids")
        min_version = policy_version if min_version is None else min_version
        if not 0 <= min_version <= policy_version:
            raise ValueError(f"step {step}: min_version {min_version} outside [0, {policy_version}]")
        args: list[Any] = [step, policy_version, min_version]
        for g in groups:
            args += [
                g.group_id,
                g.n,
                _pack("I", g.prompt_ids),
                g.max_new_tokens,
                g.seed,
                json.dumps(dict(g.sampling)),
                json.dumps(g.meta),
            ]
        return bool(self._run("enqueue", *args))

    # --- the owner's side ----------------------------------------------------------------------

    def claim(self, step: int | Sequence[int], instance_id: str, policy_version: int, max_samples: int) -> list[Claim]:
        """Lease up to `max_samples` queued samples of `step` (or of several steps, oldest first),
        partially generated ones first within a step.

        A step gives nothing to a `policy_version` outside its window (exactly its version when
        strict; [min_version, version] with bounded staleness).
        """
        if max_samples < 1:
            return []
        steps = ",".join(str(s) for s in ([step] if isinstance(step, int) else step))
        rows = self._run("claim", steps, instance_id, policy_version, max_samples, secrets.token_hex(8))
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
        """Apply many flushes in one round trip; each is accepted iff its lease is current
        (state running, same owner, same epoch), it fits the budget and, with `offset`, starts
        where the logged tokens end. A finishing flush marks the sample done; the group streams
        to the trainer when its last sample is done. Rejections count in `rejected_appends`."""
        meta: list[tuple] = []
        tokens: list[int] = []
        logprobs: list[float] = []
        for entry in flushes:
            f = entry if type(entry) is Flush else Flush(*entry)
            k = len(f.token_ids)
            if k != len(f.logprobs):
                raise ValueError(f"sample {f.sample_id}: {k} tokens but {len(f.logprobs)} logprobs")
            if f.finish_reason == "":
                raise ValueError(f"sample {f.sample_id}: empty finish_reason (use None)")
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
        if not meta:
            return []
        records = np.empty(len(tokens), dtype=RECORD)
        records["token"] = tokens
        records["logprob"] = logprobs
        reply = self._run("log", json.dumps(meta), records.tobytes())
        return [bool(ok) for ok in reply]

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
        route_s: float = 5.0,
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
        return bool(self._run("release", sample_id, instance_id, epoch, int(keep_tokens), to or "", route_ms))

    def fail(self, sample_id: str, instance_id: str, epoch: int, reason: str) -> bool:
        """Mark a leased sample failed (the engine cannot generate it); its group is dropped."""
        return bool(self._run("fail", sample_id, instance_id, epoch, reason))

    def disown(self, instance_id: str, held: Iterable[str]) -> int:
        """Requeue (tokens kept) every sample the token log says the instance runs that it does not
        hold: what a Redis that lost its last writes (an append-only file fsynced once a second)
        remembers of a finish or a flush the instance already had acknowledged. Returns how many."""
        return int(self._run("disown", instance_id, *sorted(held)))

    # --- the controller's side -----------------------------------------------------------------

    def release_all(self, instance_id: str) -> int:
        """Requeue every sample the (live) instance runs, tokens kept; returns how many."""
        return int(self._run("release_all", instance_id, 0, self.max_reaps))

    def reap(self, instance_id: str) -> int:
        """Requeue every sample of a dead instance (its epochs bump, fencing the zombie); a
        sample reaped `max_reaps` times fails instead. Returns how many samples were taken."""
        return int(self._run("release_all", instance_id, 1, self.max_reaps))

    def owners(self) -> set[str]:
        """Every instance that runs at least one sample of this run (a SCAN of ``own:*``)."""
        start = len(owned_key(self.run_id, ""))
        return {
            key[start:].decode() if isinstance(key, bytes) else key[start:]
            for key in self.client.scan_iter(match=f"{_glob_escape(self.prefix)}own:*", count=1000)
        }

    # --- the trainer's side --------------------------------------------------------------------

    def next_completed_groups(self, step: int, timeout_s: float = 0.0) -> list[int]:
        """Groups of `step` completed since the last call on this object (from the start for a
        new object), waiting up to `timeout_s` for one when there are none. Never pops: a
        restarted trainer replays them. The client's socket_timeout must exceed `timeout_s`."""
        key = done_key(self.run_id, step)
        block = max(1, int(timeout_s * 1000)) if timeout_s > 0 else None
        reply = self.client.xread({key: self._cursors.get(step, b"0")}, block=block)
        entries = reply[0][1] if reply else []
        if entries:
            self._cursors[step] = entries[-1][0]
        return [int(fields[b"g"]) for _, fields in entries]

    def read_group(self, step: int, group_id: int) -> list[SampleRecord]:
        """Every sample of a group, by index (a consistent snapshot)."""
        reply = self._run("read_group", step, group_id)
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
        reply = self._run("status", step)
        if reply is None:
            raise KeyError(f"no step {step} in run {self.run_id!r}")
        version, groups, done, dropped, queued, running, sdone, failed, tokens, dropped_ids, min_version = reply
        return StepStatus(
            step=step,
            policy_version=int(version),
            groups_total=int(groups),
            groups_done=int(done),
            groups_dropped=int(dropped),
            dropped_group_ids=tuple(sorted(int(g) for g in dropped_ids)),
            queued=queued,
            running=running,
            done=sdone,
            failed=failed,
            tokens_logged=tokens,
            min_version=int(min_version),
        )

    def stats(self) -> TokenLogStats:
        values = self.client.hgetall(self._stats_key)
        return TokenLogStats(**{f.name: int(values.get(f.name.encode(), 0)) for f in fields(TokenLogStats)})

    def delete_step(self, step: int) -> bool:
        """Free a trained step's keys (its samples' leases end); False if there was no step."""
        self._cursors.pop(step, None)
        return bool(self._run("delete_step", step))
