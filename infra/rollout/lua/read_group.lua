-- ARGV: P, step, group
local base = ARGV[2] .. '/' .. ARGV[3]
local g = redis.call('HMGET', P .. 'g:' .. base, 'n', 'prompt', 'meta')
if not g[1] then return false end
local out = {redis.call('HGET', P .. 'step:' .. ARGV[2], 'version'), g[2], g[3]}
for j = 0, tonumber(g[1]) - 1 do
  local sk = P .. 's:' .. base .. '/' .. j
  local h = redis.call('HMGET', sk, 'state', 'finish', 'attempts', 'migrations', 'outcome',
    'midturn', 'env_s', 'wait_s', 'first_ms', 'done_ms')
  out[#out + 1] = {h[1], h[2], h[3], h[4], redis.call('GET', sk .. ':r') or '',
    redis.call('GET', sk .. ':v') or '', redis.call('LRANGE', sk .. ':t', 0, -1), h[5] or '',
    h[6] or '0', h[7] or '0', h[8] or '0', h[9] or '0', h[10] or '0'}
end
return out
