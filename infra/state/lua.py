"""Lua helpers that several of the farm's Redis scripts share, as source text to prepend.

Place in the data flow: below the scripts. :mod:`infra.state.scripts` (one-job transitions),
:mod:`infra.state.group_scripts` (a worker group's transitions) and the dispatcher's script
(:mod:`infra.broker.dispatch`) start from these, so the clock, the fence and the chunked calls
are written once and every script agrees on them.
"""

# The server's clock (TIME, epoch seconds) and how the scripts store a time; the epoch of an
# attempt (this redis-server's run_id, from INFO); the terminal states; and the fence: the fencing
# token is "attempt" or "attempt:epoch", so after a rollback of Redis (kill -9, failover) a stale
# worker holding the same attempt number from before it is refused.
CLOCK_AND_FENCE = """
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) return string.format('%.6f', x) end
local function epoch()
  return string.match(redis.call('INFO', 'server'), 'run_id:(%w+)')
end
local function terminal(s) return s == 'succeeded' or s == 'failed' or s == 'canceled' end
local function fenced(state, attempts, ep, token)
  if state ~= 'running' then return false end
  local attempt, tep = string.match(token, '^(%d+):(%w+)$')
  if not attempt then return attempts == token end
  return attempts == attempt and ep == tep
end
"""

# One command over a long argument list, 4,000 arguments per call: Lua's unpack() fails past
# about 8,000 values. The list's length must be a multiple of the command's argument group
# (ZADD: score and member pairs), which 4,000 keeps for pairs.
CALL_CHUNKED = """
local function call_chunked(cmd, key, args)
  for i = 1, #args, 4000 do
    redis.call(cmd, key, unpack(args, i, math.min(i + 3999, #args)))
  end
end
"""
