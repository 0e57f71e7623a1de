-- ARGV: P, instance, reap ('1'/'0'), max reaps
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
