-- ARGV: P, step
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
local infra = {}
local fields = redis.call('HGETALL', P .. 'step:' .. step)
for i = 1, #fields, 2 do
  if string.sub(fields[i], 1, 6) == 'infra:' then
    infra[#infra + 1] = fields[i]
    infra[#infra + 1] = fields[i + 1]
  end
end
return {s[1], s[2], s[3], s[4], counts.queued, counts.running, counts.done, counts.failed,
  tokens, redis.call('SMEMBERS', P .. 'dropped:' .. step), s[5] or s[1], infra}
