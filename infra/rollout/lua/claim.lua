-- ARGV: P, steps (comma-separated, oldest first), instance, version, max_samples, nonce, weights
-- sha ('' = none). An instance whose weights sha differs from the one the publisher recorded for its
-- version (`wsha`) gets nothing and counts in `wrong_weights`. A step
-- whose version window [minv, version] holds the instance's version gives its samples routed to the
-- instance (and routed ones whose wait is over) first, then its shared queue's; then the next step.
-- A sample's first lease stamps `first_ms`; a trajectory leased again while its logged tokens end in
-- a model segment (inside a turn, or a tool call awaiting its result) counts a mid-turn migration.
local inst = ARGV[3]
if ARGV[7] ~= '' then
  local want = redis.call('HGET', P .. 'wsha', ARGV[4])
  if want and want ~= ARGV[7] then
    redis.call('HINCRBY', STATS, 'wrong_weights', 1)
    return {}
  end
end
local ck = P .. 'claimreq:' .. inst
local last = redis.call('HMGET', ck, 'nonce', 'sids')
local sids
local function lease(sid)
  local sk = P .. 's:' .. sid
  if redis.call('HINCRBY', sk, 'attempts', 1) > 1 then
    redis.call('HINCRBY', sk, 'migrations', 1)
    redis.call('HINCRBY', STATS, 'migrations', 1)
    local h = redis.call('HMGET', sk, 'lastv', 'step', 'group')
    if redis.call('STRLEN', sk .. ':r') > 0 and h[1] ~= tostring(ENV_VERSION)
        and (redis.call('HGET', P .. 'g:' .. h[2] .. '/' .. h[3], 'env') or '') ~= '' then
      redis.call('HINCRBY', sk, 'midturn', 1)
    end
  else
    redis.call('HSET', sk, 'first_ms', now_ms())
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
  local h = redis.call('HMGET', sk, 'state', 'owner', 'epoch', 'step', 'group', 'env_retries')
  if h[1] == 'running' and h[2] == inst then
    local g = redis.call('HMGET', P .. 'g:' .. h[4] .. '/' .. h[5],
      'prompt', 'max_new', 'seed', 'sampling', 'env')
    out[#out + 1] = {sid, h[3], g[1], redis.call('GET', sk .. ':r') or '', g[2], g[3], g[4],
      redis.call('GET', sk .. ':v') or '', redis.call('LRANGE', sk .. ':t', 0, -1), g[5] or '', h[6] or '0'}
  end
end
return out
