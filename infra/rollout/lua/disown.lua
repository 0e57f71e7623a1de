-- ARGV: P, instance, sample ids the instance holds...
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
