"""A worker's per-group transitions as Redis Lua scripts: one script call starts, touches (lease,
progress, group size) or succeeds every job of a group that lives in one shard.

Place in the data flow: :class:`infra.state.job_store.JobStore` runs these for the worker's
``start_many``, ``progress_many`` / ``renew_leases`` / ``mark_rendering`` and ``succeed_many``.
Each job in the call is checked and fenced on its own, exactly as the one-job scripts of
:mod:`infra.state.scripts` do (state, ``attempt:epoch`` token); what is shared is the server's
clock (one TIME), the epoch (one INFO per start call) and the writes to keys that several jobs of
the call touch: the shard's lease and pending indexes get one ZADD / ZREM each, a batch's
counters one HINCRBY per field, a tenant's quota one per field. A script is atomic, so the
merged writes leave the same state as the jobs' writes one after another.

Keys: nine per job, job i (from 0) at ``KEYS[9*i + 1 …]``, in the layout of one transition
(:mod:`infra.state.scripts`); every key of a call is in one slot on Redis Cluster, since the
caller groups the jobs by shard. ARGV: the call's own arguments, then one per job (its id, or its
token where the call fences).
"""

from infra.state.lua import CALL_CHUNKED, CLOCK_AND_FENCE

# Merged writes: zset[key][member] = score (ZADD) or false (ZREM), the last write of a member
# winning as it would one write after another; add[key][field] = the sum of the increments.
_GROUP_PRELUDE = CLOCK_AND_FENCE + CALL_CHUNKED + """
local zset, zkeys, add, akeys = {}, {}, {}, {}
local function z(key, member, score)
  if not zset[key] then zset[key] = {}; zkeys[#zkeys + 1] = key end
  zset[key][member] = score
end
local function incr(key, field, d)
  if not add[key] then add[key] = {}; akeys[#akeys + 1] = key end
  add[key][field] = (add[key][field] or 0) + d
end
local function flush()
  for _, key in ipairs(zkeys) do
    local put, del = {}, {}
    for member, score in pairs(zset[key]) do
      if score then put[#put + 1] = score; put[#put + 1] = member else del[#del + 1] = member end
    end
    if #put > 0 then call_chunked('ZADD', key, put) end
    if #del > 0 then call_chunked('ZREM', key, del) end
  end
  for _, key in ipairs(akeys) do
    for field, d in pairs(add[key]) do
      if d ~= 0 then
        if field == 'done' or field == 'gpu_s' then
          redis.call('HINCRBYFLOAT', key, field, string.format('%.17g', d))
        else
          redis.call('HINCRBY', key, field, d)
        end
      end
    end
  end
end
local function k(i, j) return KEYS[9 * (i - 1) + j] end
"""

# start, common path: queued → running, attempts += 1, a fresh lease. ARGV: worker, lease_s,
# force, then the job ids. Per job: {attempt, request, epoch, suspect_n}, {0, reason} (missing, a
# terminal state, running with a live lease), or {-1}: a running job whose lease expired, or any
# running job when forced; the caller runs the one-job start script for it, which accounts the
# lost attempt first (infra.state.scripts). The epoch is this redis-server's run_id (one INFO).
START = _GROUP_PRELUDE + """
local worker, lease_s, force = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local out, t, ep, lease = {}, nil, nil, nil
for i = 1, #ARGV - 3 do
  local id = ARGV[i + 3]
  local f = redis.call('HMGET', k(i, 1), 'state', 'request', 'attempts', 'progress', 'suspect_n', 'group_n')
  local state = f[1]
  if not state then
    z(k(i, 3), id, false)
    z(k(i, 4), id, false)
    out[i] = {0, 'missing'}
  elseif terminal(state) then
    out[i] = {0, state}
  else
    if not t then t = now(); lease = t + lease_s end
    if state == 'running' and (force == '1' or (tonumber(redis.call('ZSCORE', k(i, 3), id) or '0') or 0) <= t) then
      out[i] = {-1}
    elseif state == 'running' then
      out[i] = {0, 'running'}
    else
      if not ep then ep = epoch() end
      local attempt = (tonumber(f[3] or '0') or 0) + 1
      incr(k(i, 2), state, -1)
      incr(k(i, 2), 'running', 1)
      incr(k(i, 2), 'done', -(tonumber(f[4] or '0') or 0))
      redis.call('HSET', k(i, 1), 'state', 'running', 'attempts', attempt, 'worker', worker, 'started_at', fmt(t),
                 'progress', '0', 'epoch', ep)
      if f[6] then redis.call('HDEL', k(i, 1), 'group_n') end
      z(k(i, 3), id, lease)
      z(k(i, 4), id, false)
      out[i] = {attempt, f[2], ep, tonumber(f[5] or '0') or 0}
    end
  end
end
flush()
return out
"""

# progress / renew, per job of the call: only for the current attempt of a running job; extends
# its lease (its score in the shard's lease index); the job's hash is written only when its
# progress grows or its group size changes. ARGV: lease_s, then per job four: id, token,
# progress ('' = leave it), group ('' = leave it). Per job: 1 (ours), 0 (stale), 2 (canceled).
TOUCH = _GROUP_PRELUDE + """
local lease = now() + tonumber(ARGV[1])
local out = {}
for i = 1, (#ARGV - 1) / 4 do
  local id, token, progress, group = ARGV[4 * i - 2], ARGV[4 * i - 1], ARGV[4 * i], ARGV[4 * i + 1]
  local f = redis.call('HMGET', k(i, 1), 'state', 'attempts', 'epoch', 'progress', 'group_n')
  if f[1] == 'canceled' then
    out[i] = 2
  elseif not fenced(f[1], f[2], f[3], token) then
    out[i] = 0
  else
    local set = {}
    if group ~= '' and group ~= f[5] then set[#set + 1] = 'group_n'; set[#set + 1] = group end
    if progress ~= '' then
      local new, old = tonumber(progress), tonumber(f[4] or '0') or 0
      if new > old then
        set[#set + 1] = 'progress'; set[#set + 1] = progress
        incr(k(i, 2), 'done', new - old)
      end
    end
    if #set > 0 then redis.call('HSET', k(i, 1), unpack(set)) end
    z(k(i, 3), id, lease)
    out[i] = 1
  end
end
flush()
return out
"""

# succeed, per job of the call: running (this attempt) → succeeded with its result; gives its
# quota back and sets its TTL; its batch's keys get theirs once none of its jobs is queued or
# running. ARGV: per job three: id, token, result (JSON). Per job: 1, or 0 (stale or ended).
SUCCEED = _GROUP_PRELUDE + """
local t = now()
local out, ended = {}, {}
for i = 1, #ARGV / 3 do
  local id, token, result = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  local f = redis.call('HMGET', k(i, 1), 'state', 'attempts', 'epoch', 'progress', 'ttl_s', 'cost_s', 'cost_bytes')
  if not fenced(f[1], f[2], f[3], token) then
    out[i] = 0
  else
    incr(k(i, 2), 'running', -1)
    incr(k(i, 2), 'succeeded', 1)
    incr(k(i, 2), 'done', 1 - (tonumber(f[4] or '0') or 0))
    redis.call('HSET', k(i, 1), 'state', 'succeeded', 'finished_at', fmt(t), 'progress', '1', 'result', result)
    z(k(i, 3), id, false)
    z(k(i, 4), id, false)
    if KEYS[9 * i] then
      if f[6] then
        incr(k(i, 9), 'jobs', -1)
        incr(k(i, 9), 'gpu_s', -(tonumber(f[6]) or 0))
      end
      incr(k(i, 9), 'bytes', -(tonumber(f[7] or '0') or 0))
    end
    local ttl = tonumber(f[5] or '0') or 0
    if ttl > 0 then
      redis.call('EXPIRE', k(i, 1), ttl)
      if not ended[k(i, 2)] then ended[k(i, 2)] = {ttl, k(i, 7), k(i, 8)} end
    end
    out[i] = 1
  end
end
flush()
for counts, e in pairs(ended) do
  local qr = redis.call('HMGET', counts, 'queued', 'running')
  if (tonumber(qr[1] or '0') or 0) + (tonumber(qr[2] or '0') or 0) <= 0 then
    for _, key in ipairs({counts, e[2], e[3]}) do redis.call('EXPIRE', key, e[1]) end
  end
end
return out
"""
