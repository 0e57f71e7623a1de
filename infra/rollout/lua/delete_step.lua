-- ARGV: P, step
local step = ARGV[2]
if redis.call('EXISTS', P .. 'step:' .. step) == 0 then return 0 end
for _, gid in ipairs(redis.call('LRANGE', P .. 'groups:' .. step, 0, -1)) do
  local gk = P .. 'g:' .. step .. '/' .. gid
  for j = 0, tonumber(redis.call('HGET', gk, 'n')) - 1 do
    local sid = step .. '/' .. gid .. '/' .. j
    local sk = P .. 's:' .. sid
    local h = redis.call('HMGET', sk, 'state', 'owner')
    if h[1] == 'running' then redis.call('SREM', P .. 'own:' .. h[2], sid) end
    redis.call('DEL', sk, sk .. ':r', sk .. ':v', sk .. ':t')
  end
  redis.call('DEL', gk)
end
redis.call('DEL', P .. 'step:' .. step, P .. 'groups:' .. step, P .. 'q:' .. step,
  P .. 'qr:' .. step, P .. 'done:' .. step, P .. 'dropped:' .. step)
return 1
