-- Prepended to every token-log script (`infra.rollout.tokenlog`). Every script gets KEYS[1] = the
-- shard's stats key (routes a cluster client to the shard's slot) and ARGV[1] = the shard's key prefix.
local P = ARGV[1]
local STATS = KEYS[1]

-- the version of an environment segment's tokens (`tokenlog.ENV_VERSION`)
local ENV_VERSION = 4294967295

-- a sample of (step, group) became `field` ('done' or 'failed'): complete or drop the group (a
-- renormalized group whose failures are all the infrastructure's completes without them)
local function settle(step, group, field)
  local gk = P .. 'g:' .. step .. '/' .. group
  redis.call('HINCRBY', gk, field, 1)
  local g = redis.call('HMGET', gk, 'n', 'done', 'failed', 'renorm', 'infra')
  local done, failed = tonumber(g[2]), tonumber(g[3])
  if done + failed == tonumber(g[1]) then
    if failed == 0 or (g[4] == '1' and tonumber(g[5] or 0) == failed and done > 0) then
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
    redis.call('DEL', sk .. ':r', sk .. ':v', sk .. ':t')
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

-- an `infra:<kind>` reason counts in the step (by kind) and the group (for renormalize)
local function fail(sk, step, group, reason)
  redis.call('HINCRBY', sk, 'epoch', 1)
  redis.call('HSET', sk, 'state', 'failed', 'finish', reason)
  redis.call('HINCRBY', STATS, 'failed_samples', 1)
  if string.sub(reason, 1, 6) == 'infra:' then
    redis.call('HINCRBY', P .. 'step:' .. step, reason, 1)
    redis.call('HINCRBY', P .. 'g:' .. step .. '/' .. group, 'infra', 1)
  end
  settle(step, group, 'failed')
end
