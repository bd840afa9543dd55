"""The job-state store's transitions as Redis Lua scripts: one script per transition.

Place in the data flow: :class:`infra.state.job_store.JobStore` runs these for submission's records,
the worker's start/progress/finish, the reaper's requeue and the operator's dead-letter retry.
Each script is atomic over every key it touches and re-checks its condition, so a transition
happens at most once whatever runs it concurrently (several workers, reapers or API replicas).
"""

from infra.state.lua import CLOCK_AND_FENCE

# Every transition script gets the same keys, so each one is atomic over everything it touches;
# every key is in the job's shard s (hash tag {s}), so on Redis Cluster the script runs in one slot:
#   KEYS[1] job hash   KEYS[2] its batch's counts hash
#   KEYS[3] rf:leases:{s}  KEYS[4] rf:pending:{s}  KEYS[5] rf:dead:{s}      ARGV[1] the job id
#   KEYS[6] rf:dead:{tenant}:{s}, the job's tenant's own dead-letter index (finish, requeue, retry)
#   KEYS[7] its batch's hash   KEYS[8] its batch's job list
#   KEYS[9] rf:quota:{tenant}:{s} (Redis Cluster; on one Redis rf:quota:{tenant} itself): a job
#           with ``cost_s`` gives its job and GPU-seconds back when it ends, and one with
#           ``cost_bytes`` its record's bytes (a record without the field, from before the byte
#           quota, gives back 0); a dead-letter retry takes them again (infra.state.quota)
# Only INFO and TIME are read besides these keys; no key is named inside a script.
# Expiry: a job written with a ``ttl_s`` field has no TTL while queued or running; each move to a
# terminal state sets its TTL afresh, and its batch's keys get theirs once no job of the batch is
# queued or running (expire_ended). Only a dead-letter retry takes a job from a terminal state
# back to a live one, so only it removes those TTLs again (keep); every other transition starts
# from a live job, whose keys have none. Records without ``ttl_s`` keep their creation TTL.
# Times are the Redis server's clock (TIME), so a lease never depends on a worker's clock.
_PRELUDE = CLOCK_AND_FENCE + """
local id = ARGV[1]
local function move(old, new)
  redis.call('HINCRBY', KEYS[2], old, -1)
  redis.call('HINCRBY', KEYS[2], new, 1)
end
local function ttl() return tonumber(redis.call('HGET', KEYS[1], 'ttl_s') or '0') or 0 end
local function quota(sign)
  if not KEYS[9] then return end
  local c = redis.call('HMGET', KEYS[1], 'cost_s', 'cost_bytes')
  local cost = c[1]
  if cost then
    redis.call('HINCRBY', KEYS[9], 'jobs', sign)
    redis.call('HINCRBYFLOAT', KEYS[9], 'gpu_s', sign * (tonumber(cost) or 0))
  end
  local bytes = tonumber(c[2] or '0') or 0
  if bytes ~= 0 then redis.call('HINCRBY', KEYS[9], 'bytes', sign * bytes) end
end
local function keep()
  if ttl() <= 0 then return end
  for _, k in ipairs({KEYS[1], KEYS[2], KEYS[7], KEYS[8]}) do redis.call('PERSIST', k) end
end
local function expire_ended()
  local s = ttl()
  if s <= 0 then return end
  redis.call('EXPIRE', KEYS[1], s)
  local qr = redis.call('HMGET', KEYS[2], 'queued', 'running')
  local open = (tonumber(qr[1] or '0') or 0) + (tonumber(qr[2] or '0') or 0)
  if open <= 0 then
    for _, k in ipairs({KEYS[2], KEYS[7], KEYS[8]}) do redis.call('EXPIRE', k, s) end
  end
end
local function num(field) return tonumber(redis.call('HGET', KEYS[1], field) or '0') or 0 end
local function used() return num('attempts') - num('attempt_base') end
-- a running job's lease: its score in the shard's lease index (the hash keeps no copy)
local function lease_of() return tonumber(redis.call('ZSCORE', KEYS[3], id) or '0') or 0 end
-- this attempt's fence (infra.state.lua): one HMGET reads the three fields it compares; the
-- epoch is stored as the job's 'epoch' when the attempt starts
local function ours(token)
  local f = redis.call('HMGET', KEYS[1], 'state', 'attempts', 'epoch')
  return fenced(f[1], f[2], f[3], token)
end
-- back to queued for another attempt; the attempt counter is kept (it fences)
local function requeue(state, t, err)
  local share = terminal(state) and 1 or num('progress')
  move(state, 'queued')
  redis.call('HINCRBYFLOAT', KEYS[2], 'done', -share)
  redis.call('HSET', KEYS[1], 'state', 'queued', 'progress', '0', 'queued_at', fmt(t))
  if err ~= '' then redis.call('HSET', KEYS[1], 'last_error', err) end
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZADD', KEYS[4], t, id)
end
-- a worker holding this attempt was lost (its lease expired: killed, or stopped by its render
-- watchdog). Bisection across attempts (module docstring): the attempt is charged only when the
-- job was rendering alone (group_n = 1); in a larger group it is refunded and the job becomes a
-- suspect (suspect_n = that group's size, so its next attempts render in halves of it); not
-- rendering at all (waiting in the worker), refunded. Every loss counts in 'losses', whose cap
-- ends any loop. Returns the WorkerLost error (JSON) and whether the job must fail now.
local function lost(max_attempts, max_losses)
  local g = num('group_n')
  local losses = redis.call('HINCRBY', KEYS[1], 'losses', 1)
  if g == 1 then
    redis.call('HINCRBY', KEYS[1], 'kills', 1)
  else
    redis.call('HINCRBY', KEYS[1], 'attempt_base', 1)
  end
  if g > 1 then redis.call('HSET', KEYS[1], 'suspect_n', g) end
  redis.call('HDEL', KEYS[1], 'group_n')
  local how = g == 1 and 'while rendering it alone' or (g > 1 and ('while rendering it in a group of ' .. g) or
    'before rendering it (attempt not charged)')
  local err = cjson.encode({type = 'WorkerLost', message = 'lease expired: worker ' ..
    (redis.call('HGET', KEYS[1], 'worker') or '?') .. ' stopped renewing attempt ' .. num('attempts') ..
    ' ' .. how .. ' (' .. used() .. ' of ' .. max_attempts .. ' attempts used, ' .. losses .. ' workers lost)'})
  return err, used() >= tonumber(max_attempts) or losses >= tonumber(max_losses)
end
local function finish(state, new, t, field, payload)
  local old = num('progress')
  move(state, new)
  redis.call('HINCRBYFLOAT', KEYS[2], 'done', 1 - old)
  redis.call('HSET', KEYS[1], 'state', new, 'finished_at', fmt(t),
             'progress', new == 'succeeded' and '1' or tostring(old))
  if field ~= '' then redis.call('HSET', KEYS[1], field, payload) end
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZREM', KEYS[4], id)
  if new == 'failed' then
    redis.call('ZADD', KEYS[5], t, id)
    if KEYS[6] then redis.call('ZADD', KEYS[6], t, id) end
  end
  quota(-1)
  expire_ended()
end
"""

# start: queued|running → running, attempts += 1. ARGV: id, worker, lease_s, force, max_attempts,
# max_losses. Returns {attempt, request, epoch, suspect_n} or {0, reason}; the attempt's epoch (the
# server's run_id) is stored with it. A running job is taken over only when its lease has
# expired, or when forced; an expired attempt is accounted first as the reaper would (lost()),
# and the job fails instead when that spends its budget.
START = _PRELUDE + """
local head = redis.call('HMGET', KEYS[1], 'state', 'request')
local state = head[1]
if not state then
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZREM', KEYS[4], id)
  return {0, 'missing'}
end
if terminal(state) then return {0, state} end
local t = now()
if state == 'running' and ARGV[4] ~= '1' then
  if lease_of() > t then return {0, 'running'} end
  local err, spent = lost(ARGV[5], ARGV[6])
  if spent then
    finish(state, 'failed', t, 'error', err)
    redis.call('HSET', KEYS[1], 'last_error', err)
    return {0, 'failed'}
  end
end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
local old = num('progress')
if state ~= 'running' then move(state, 'running') end
redis.call('HINCRBYFLOAT', KEYS[2], 'done', -old)
local lease = t + tonumber(ARGV[3])
local ep = epoch()
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[2], 'started_at', fmt(t), 'progress', '0',
           'epoch', ep)
redis.call('HDEL', KEYS[1], 'group_n')
redis.call('ZADD', KEYS[3], lease, id)
redis.call('ZREM', KEYS[4], id)
return {attempt, head[2], ep, num('suspect_n')}
"""

# finish: running (this attempt; '*' = any non-terminal state) → succeeded|failed|canceled.
# ARGV: id, token (attempt[:epoch]) | '*', state, field, json, retry ('1'), max_attempts.
# Returns 1 (finished), 2 (a retryable failure went back to queued), 0 (stale or already ended).
FINISH = _PRELUDE + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or terminal(state) then return 0 end
if ARGV[2] ~= '*' and not ours(ARGV[2]) then return 0 end
local t = now()
if ARGV[3] == 'failed' and ARGV[6] == '1' and used() < tonumber(ARGV[7]) then
  requeue(state, t, ARGV[5])
  return 2
end
finish(state, ARGV[3], t, ARGV[4], ARGV[5])
if ARGV[3] == 'failed' then redis.call('HSET', KEYS[1], 'last_error', ARGV[5]) end
return 1
"""

# requeue (the reaper): running with an expired lease → queued, or → failed (dead letter) when
# the attempt budget (or the cap on lost workers) is spent; the loss is accounted by lost().
# ARGV: id, max_attempts, max_losses. Returns {1, pool} requeued, {2, ''} failed, {0, ''}
# nothing to do (the index entry is repaired).
REQUEUE = _PRELUDE + """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'running' then
  redis.call('ZREM', KEYS[3], id)
  if not state then redis.call('ZREM', KEYS[4], id) end
  return {0, ''}
end
local t = now()
local lease = lease_of()
if lease > t then
  redis.call('ZADD', KEYS[3], lease, id)
  return {0, ''}
end
local err, spent = lost(ARGV[2], ARGV[3])
if spent then
  finish(state, 'failed', t, 'error', err)
  redis.call('HSET', KEYS[1], 'last_error', err)
  return {2, ''}
end
requeue(state, t, err)
return {1, redis.call('HGET', KEYS[1], 'pool') or ''}
"""

# release (graceful shutdown): this attempt of a running job → queued, without spending the
# attempt budget. ARGV: id, token (attempt[:epoch]). Returns {1, pool} or {0, ''}.
RELEASE = _PRELUDE + """
if not ours(ARGV[2]) then return {0, ''} end
redis.call('HINCRBY', KEYS[1], 'attempt_base', 1)
requeue('running', now(), '')
return {1, redis.call('HGET', KEYS[1], 'pool') or ''}
"""

# retry (dead letter): failed → queued with a fresh attempt budget (and a fresh cap on lost
# workers). A job that killed its worker while rendering alone ('kills') may be retried at most
# ARGV[2] times. ARGV: id, max_kill_retries. Returns {1, pool}, {0, state}, or {0, 'killer', kills}.
RETRY = _PRELUDE + """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'failed' then
  if not state then
    redis.call('ZREM', KEYS[5], id)
    if KEYS[6] then redis.call('ZREM', KEYS[6], id) end
  end
  return {0, state or 'missing'}
end
if num('kills') > 0 then
  if num('kill_retries') >= tonumber(ARGV[2]) then return {0, 'killer', num('kills')} end
  redis.call('HINCRBY', KEYS[1], 'kill_retries', 1)
end
redis.call('HSET', KEYS[1], 'attempt_base', redis.call('HGET', KEYS[1], 'attempts'), 'losses', '0')
requeue(state, now(), redis.call('HGET', KEYS[1], 'error') or '')
keep()
quota(1)
redis.call('HDEL', KEYS[1], 'error', 'finished_at')
redis.call('ZREM', KEYS[5], id)
if KEYS[6] then redis.call('ZREM', KEYS[6], id) end
return {1, redis.call('HGET', KEYS[1], 'pool') or ''}
"""

# Submission's job records: KEYS = the new jobs' hashes (one slot: a batch's job ids carry its
# shard); ARGV[1..5] = batch id, tenant, priority, created_at, ttl_s, shared by every job, then four
# per job: pool, request JSON, cost_s, cost_bytes ("" = not counted, no field). One call writes a
# whole chunk of a batch inside the batch's MULTI/EXEC: the common fields travel once instead of in
# every job's HSET, which was most of a 10,000-job submission's client-side packing. One table of
# fields is built per call and each job overwrites its own slots (pool, request, the costs present)
# before unpacking its first n entries: building a table per job took 49.8 and 41.4 ms of
# redis-server time per 5,000 jobs against 38.2 and 37.0 ms (two runs, medians of 6 alternating
# calls each, 2-vCPU Intel Xeon with AMX).
CREATE = """
local f = {'batch_id', ARGV[1], 'tenant', ARGV[2], 'pool', '', 'state', 'queued', 'progress', '0',
           'attempts', '0', 'created_at', ARGV[4], 'request', '', 'priority', ARGV[3], 'ttl_s', ARGV[5]}
for i = 1, #KEYS do
  local a = 5 + 4 * (i - 1)
  f[6], f[16] = ARGV[a + 1], ARGV[a + 2]
  local n = 20
  if ARGV[a + 3] ~= '' then f[n + 1] = 'cost_s'; f[n + 2] = ARGV[a + 3]; n = n + 2 end
  if ARGV[a + 4] ~= '' then f[n + 1] = 'cost_bytes'; f[n + 2] = ARGV[a + 4]; n = n + 2 end
  redis.call('HSET', KEYS[i], unpack(f, 1, n))
end
return #KEYS
"""
