-- ARGV: P, sample, instance, epoch, reason
local sid, inst = ARGV[2], ARGV[3]
local sk = P .. 's:' .. sid
local h = redis.call('HMGET', sk, 'state', 'owner', 'epoch', 'step', 'group')
if h[1] ~= 'running' or h[2] ~= inst or h[3] ~= ARGV[4] then return 0 end
redis.call('SREM', P .. 'own:' .. inst, sid)
fail(sk, h[4], h[5], ARGV[5])
return 1
