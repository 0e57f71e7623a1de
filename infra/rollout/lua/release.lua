-- ARGV: P, sample, instance, epoch, keep tokens ('1'/'0'), route to ('' = the shared queue),
-- route ms, an environment retry ('1': counted in the sample's env_retries)
local sid, inst, to = ARGV[2], ARGV[3], ARGV[6]
local sk = P .. 's:' .. sid
local h = redis.call('HMGET', sk, 'state', 'owner', 'epoch', 'step')
if h[1] ~= 'running' or h[2] ~= inst or h[3] ~= ARGV[4] then return 0 end
redis.call('SREM', P .. 'own:' .. inst, sid)
if ARGV[8] == '1' then redis.call('HINCRBY', sk, 'env_retries', 1) end
requeue(sid, sk, h[4], ARGV[5] == '1', to, to ~= '' and now_ms() + tonumber(ARGV[7]) or 0)
return 1
