-- ARGV: P, step, version, min version, then per group: id, n, prompt, max_new, seed, sampling, meta,
-- environment ('' = none), renormalize ('1': an infra failure leaves the group complete without it)
local step = ARGV[2]
local stk = P .. 'step:' .. step
if redis.call('EXISTS', stk) == 1 then return 0 end
local seq, groups = 0, 0
for i = 5, #ARGV, 9 do
  local gid, n, max_new = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 3]
  redis.call('HSET', P .. 'g:' .. step .. '/' .. gid, 'n', n, 'done', 0, 'failed', 0,
    'prompt', ARGV[i + 2], 'max_new', max_new, 'seed', ARGV[i + 4], 'sampling', ARGV[i + 5],
    'meta', ARGV[i + 6], 'env', ARGV[i + 7], 'renorm', ARGV[i + 8], 'infra', 0)
  redis.call('RPUSH', P .. 'groups:' .. step, gid)
  for j = 0, n - 1 do
    local sid = step .. '/' .. gid .. '/' .. j
    redis.call('HSET', P .. 's:' .. sid, 'state', 'queued', 'owner', '', 'epoch', 0,
      'attempts', 0, 'migrations', 0, 'reaps', 0, 'finish', '', 'step', step, 'group', gid,
      'max_new', max_new, 'minv', ARGV[4], 'lastv', '')
    seq = seq + 1
    redis.call('ZADD', P .. 'q:' .. step, seq, sid)
  end
  groups = groups + 1
end
redis.call('HSET', stk, 'version', ARGV[3], 'minv', ARGV[4], 'groups', groups, 'groups_done', 0,
  'groups_dropped', 0, 'seq', seq)
return 1
