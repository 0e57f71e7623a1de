-- ARGV: P, JSON [[sample, instance, epoch, offset (-1 = none), token count, finish reason
-- ('' = none), policy version (-1 = none), source ('model' | 'env'), observation (JSON, env only),
-- turn (env only), outcome (JSON, '' = none), environment seconds, tool-wait seconds, weights sha
-- ('' = none)], ...], every flush's records (8 bytes each) concatenated.
-- A model flush whose weights sha differs from the one the publisher recorded for its version
-- (`wsha`; a flush without a version: the step's) is rejected and counts in `wrong_weights`.
-- A model flush whose version is below the sample's window (`minv`) is rejected; an env flush (an
-- environment segment) is not checked: its tokens get version ENV_VERSION. An accepted flush whose
-- version differs from the sample's last opens a version span (u32 offset, u32 version) in :v (a
-- model flush without a version after an env segment: the step's version). An accepted env flush
-- records its turn in :t once ('<offset>:<observation>'), however often it is redelivered; it and a
-- finishing flush add the seconds of the environment step that answered the turn and of the
-- trajectory's wait for it (`env_s`, `wait_s`), once; a finishing flush stamps `done_ms`.
local function add_env_seconds(sk, env_s, wait_s)
  if env_s > 0 then redis.call('HINCRBYFLOAT', sk, 'env_s', env_s) end
  if wait_s > 0 then redis.call('HINCRBYFLOAT', sk, 'wait_s', wait_s) end
end
local function wrong_weights(sha, ver, step)
  if sha == '' or sha == nil then return false end
  if ver < 0 then ver = tonumber(redis.call('HGET', P .. 'step:' .. step, 'version') or -1) end
  local want = redis.call('HGET', P .. 'wsha', ver)
  return want ~= false and want ~= sha
end
local recs = ARGV[3]
local out, rejected, wrong, pos = {}, 0, 0, 1
for _, m in ipairs(cjson.decode(ARGV[2])) do
  local sid, inst, epoch, offset, k, fin, ver = m[1], m[2], m[3], m[4], m[5], m[6], m[7]
  local env = m[8] == 'env'
  local rec = string.sub(recs, pos, pos + 8 * k - 1)
  pos = pos + 8 * k
  local sk = P .. 's:' .. sid
  local rk = sk .. ':r'
  local h = redis.call('HMGET', sk, 'state', 'owner', 'epoch', 'max_new', 'minv', 'lastv', 'step')
  if env then ver = ENV_VERSION end
  local ok = 0
  local bad = not env and h[7] and wrong_weights(m[14], ver, h[7])
  if bad then wrong = wrong + 1 end
  if not bad and h[2] == inst and tonumber(h[3]) == epoch and (env or ver < 0 or ver >= tonumber(h[5] or 0)) then
    if h[1] == 'running' then
      -- Append first (APPEND returns the new length), then check; undo what does not fit.
      local len = redis.call('APPEND', rk, rec)
      local have = len / 8 - k
      if (offset < 0 or offset == have) and len / 8 <= tonumber(h[4]) then
        if ver < 0 and h[6] == tostring(ENV_VERSION) then
          ver = tonumber(redis.call('HGET', P .. 'step:' .. h[7], 'version'))
        end
        if ver >= 0 and k > 0 and h[6] ~= tostring(ver) then
          redis.call('APPEND', sk .. ':v', struct.pack('<I4I4', have, ver))
          redis.call('HSET', sk, 'lastv', ver)
        end
        if env and redis.call('LLEN', sk .. ':t') == m[10] then
          redis.call('RPUSH', sk .. ':t', have .. ':' .. m[9])
          add_env_seconds(sk, m[12], m[13])
        end
        if fin ~= '' then
          add_env_seconds(sk, m[12], m[13])
          redis.call('HSET', sk, 'state', 'done', 'finish', fin, 'done_ms', now_ms())
          if m[11] ~= '' then redis.call('HSET', sk, 'outcome', m[11]) end
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
if wrong > 0 then redis.call('HINCRBY', STATS, 'wrong_weights', wrong) end
return out
