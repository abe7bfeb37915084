"""The ledger's Lua scripts: each one is atomic and touches the keys of one request, or
of one worker, or one global key, so that every script runs on Redis Cluster (all of
its KEYS share a slot). Redis 6.2 commands only.

A refusal is an error reply starting with CONFLICT_TAG; ledger.ledger turns it into
LedgerConflict. Times come from the server's TIME (milliseconds, as strings).
"""

from __future__ import annotations

CONFLICT_TAG = "TDCONFLICT"

# Shared prelude: effects replication (TIME before writes), server time, refusals.
_PRELUDE = """
redis.replicate_commands()
local function now_ms()
  local t = redis.call('TIME')
  return t[1] .. string.sub(string.format('%06d', tonumber(t[2])), 1, 3)
end
local function conflict(msg)
  return redis.error_reply('TDCONFLICT ' .. msg)
end
local TERMINAL = {FINISHED = true, FAILED = true, CANCELLED = true}
-- The record KEYS[1] of request rid must be in state `expected` and owned at `epoch` (by
-- `owner` too, unless it is nil). Returns a refusal to return as is, or nil when it is.
-- `edge` (may be '') names the refused move in the message.
local function check_owner(rid, expected, owner, epoch, edge)
  local cur = redis.call('HMGET', KEYS[1], 'state', 'owner', 'epoch')
  if not cur[1] then
    return conflict('request ' .. rid .. ': expected state ' .. expected ..
      ', found no record (unknown or expired)')
  end
  if cur[1] ~= expected then
    return conflict('request ' .. rid .. ': expected state ' .. expected .. ', found ' ..
      cur[1] .. edge)
  end
  if cur[3] ~= epoch or (owner and cur[2] ~= owner) then
    return conflict('request ' .. rid .. ': stale epoch: expected owner ' .. cur[2] ..
      ' at epoch ' .. cur[3] .. ', got ' .. (owner and (owner .. ' at ') or 'epoch ') .. epoch)
  end
  return nil
end
"""

# KEYS: record. ARGV: request_id, owner, epoch, ttl_ms, field, value, ...
# An id may be used again once its request failed with a status the client retries.
CREATE_REQUEST = (
    _PRELUDE
    + """
local old = redis.call('HMGET', KEYS[1], 'state', 'retryable')
if old[1] then
  if not (old[1] == 'FAILED' and old[2] == '1') then
    return conflict('request ' .. ARGV[1] .. ': expected no record, found one in ' .. old[1] ..
      ' (duplicate id)')
  end
  redis.call('DEL', KEYS[1])  -- the failed attempt's fields go with it
end
local now = now_ms()
redis.call('HSET', KEYS[1], 'state', 'QUEUED', 'owner', ARGV[2], 'epoch', ARGV[3],
  'version', '0', 'created_ms', now, 'updated_ms', now, unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return redis.call('HGETALL', KEYS[1])
"""
)

# KEYS: record. ARGV: request_id, expected, to, epoch, new_owner ('' keeps), new_epoch,
# ttl_ms, error ('' none), retryable ('1': the id may be used again). The caller checked
# that expected -> to is a legal edge.
TRANSITION = (
    _PRELUDE
    + """
local refused = check_owner(ARGV[1], ARGV[2], nil, ARGV[4],
  ' (' .. ARGV[2] .. ' -> ' .. ARGV[3] .. ' refused)')
if refused then return refused end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'updated_ms', now_ms())
redis.call('HINCRBY', KEYS[1], 'version', 1)
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'owner', ARGV[5], 'epoch', ARGV[6])
end
if ARGV[8] ~= '' then
  redis.call('HSET', KEYS[1], 'error', ARGV[8])
end
if ARGV[9] == '1' then
  redis.call('HSET', KEYS[1], 'retryable', '1')
end
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return redis.call('HGETALL', KEYS[1])
"""
)

# KEYS: record, holders, pool set, lease, target set, draft set.
# ARGV: request_id, worker, epoch, lease_ms, block ids...
# Returns the number of blocks the worker now holds in that pool.
CLAIM_BLOCKS = (
    _PRELUDE
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return conflict('request ' .. ARGV[1] .. ': expected a live request, found no record')
end
if TERMINAL[state] then
  return conflict('request ' .. ARGV[1] .. ': expected a live request, found ' .. state)
end
local held = redis.call('HGET', KEYS[2], ARGV[2])
if held and held ~= ARGV[3] then
  if tonumber(held) > tonumber(ARGV[3]) then
    return conflict('request ' .. ARGV[1] .. ': stale epoch for worker ' .. ARGV[2] ..
      ': expected ' .. held .. ', got ' .. ARGV[3])
  end
  -- A newer instance of the worker: the old instance's blocks died with it.
  redis.call('DEL', KEYS[5], KEYS[6])
elseif held and redis.call('EXISTS', KEYS[4]) == 0 then
  return conflict('request ' .. ARGV[1] .. ': lease of worker ' .. ARGV[2] ..
    ' expected alive, found expired')
end
for i = 5, #ARGV, 1000 do
  redis.call('SADD', KEYS[3], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('SET', KEYS[4], ARGV[3], 'PX', ARGV[4])
return redis.call('SCARD', KEYS[3])
"""
)

# KEYS: record, holders, lease, target set, draft set.
# ARGV: request_id, worker, epoch, expected state, number of target blocks held now,
# has_draft ('1' or '0'), number of added ids n, added ids (n of them), removed ids...
# The owner's allocator grew (or shrank) the request's table: the worker must own the
# request at its epoch in the expected state, hold its blocks under a live lease, and the
# ledger must hold as many blocks as the worker recorded last (else an update was lost, or
# the data went back in time). Returns the number of target blocks now held.
RESIZE_BLOCKS = (
    _PRELUDE
    + """
local refused = check_owner(ARGV[1], ARGV[4], ARGV[2], ARGV[3], '')
if refused then return refused end
local held = redis.call('HGET', KEYS[2], ARGV[2])
if held ~= ARGV[3] then
  return conflict('request ' .. ARGV[1] .. ': expected blocks held by worker ' .. ARGV[2] ..
    ' at epoch ' .. ARGV[3] .. ', found ' .. (held and ('epoch ' .. held) or 'none'))
end
if redis.call('EXISTS', KEYS[3]) == 0 then
  return conflict('request ' .. ARGV[1] .. ': lease of worker ' .. ARGV[2] ..
    ' expected alive, found expired')
end
local num_held = redis.call('SCARD', KEYS[4])
if num_held ~= tonumber(ARGV[5]) then
  return conflict('request ' .. ARGV[1] .. ': expected ' .. ARGV[5] .. ' blocks held by worker ' ..
    ARGV[2] .. ', found ' .. num_held)
end
local sets = {KEYS[4]}
if ARGV[6] == '1' then table.insert(sets, KEYS[5]) end
local first_removed = 8 + tonumber(ARGV[7])
for _, key in ipairs(sets) do
  for i = 8, first_removed - 1, 1000 do
    redis.call('SADD', key, unpack(ARGV, i, math.min(i + 999, first_removed - 1)))
  end
  for i = first_removed, #ARGV, 1000 do
    redis.call('SREM', key, unpack(ARGV, i, math.min(i + 999, #ARGV)))
  end
end
num_held = redis.call('SCARD', KEYS[4])
if num_held == 0 then  -- as FREE_BLOCKS: holding nothing ends the holding
  redis.call('HDEL', KEYS[2], ARGV[2])
  redis.call('DEL', KEYS[3])
end
return num_held
"""
)

# KEYS: record, holders, lease, target set, draft set.
# ARGV: request_id, worker, epoch, request_ttl_ms, lease_ms, has_draft ('1' or '0'),
# stale_before_ms, number of field arguments n, field, value, ... (n of them), block ids...
# After the ledger's data was lost (Redis restarted empty, or restored from a snapshot):
# the decode worker that is decoding a request records it again, DECODING and its own at
# its new epoch, with the blocks it holds (both pools when it has a draft) under a lease.
# A record last changed before stale_before_ms (the new generation's start), and not
# ended, is an image from before the loss and is replaced; any other is left alone:
# someone recorded the request meanwhile and the worker must drop it.
RESTORE_DECODING = (
    _PRELUDE
    + """
local cur = redis.call('HMGET', KEYS[1], 'state', 'updated_ms')
if cur[1] and (TERMINAL[cur[1]] or tonumber(cur[2]) >= tonumber(ARGV[7])) then
  return conflict('request ' .. ARGV[1] .. ': expected no record to restore, found one (' ..
    cur[1] .. ' since ' .. tostring(cur[2]) .. ')')
end
local now = now_ms()
local num_fields = tonumber(ARGV[8])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'state', 'DECODING', 'owner', ARGV[2], 'epoch', ARGV[3],
  'version', '0', 'created_ms', now, 'updated_ms', now, 'restored_ms', now,
  unpack(ARGV, 9, 8 + num_fields))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('DEL', KEYS[4], KEYS[5])
local first = 9 + num_fields
for i = first, #ARGV, 1000 do
  local last = math.min(i + 999, #ARGV)
  redis.call('SADD', KEYS[4], unpack(ARGV, i, last))
  if ARGV[6] == '1' then
    redis.call('SADD', KEYS[5], unpack(ARGV, i, last))
  end
end
if #ARGV >= first then
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
  redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[5])
end
return redis.call('HGETALL', KEYS[1])
"""
)

# KEYS: holders, lease, target set, draft set. ARGV: request_id, worker, epoch,
# pool ('' for both), block ids... (none: all of the pool). Returns {freed, remaining}.
FREE_BLOCKS = (
    _PRELUDE
    + """
local held = redis.call('HGET', KEYS[1], ARGV[2])
if not held then
  return {0, 0}
end
if held ~= ARGV[3] then
  return conflict('request ' .. ARGV[1] .. ': stale epoch for worker ' .. ARGV[2] ..
    ': expected ' .. held .. ', got ' .. ARGV[3])
end
local freed = 0
local sets = {}
if ARGV[4] == '' or ARGV[4] == 'target' then table.insert(sets, KEYS[3]) end
if ARGV[4] == '' or ARGV[4] == 'draft' then table.insert(sets, KEYS[4]) end
for _, key in ipairs(sets) do
  if #ARGV == 4 then
    freed = freed + redis.call('SCARD', key)
    redis.call('DEL', key)
  else
    for i = 5, #ARGV, 1000 do
      freed = freed + redis.call('SREM', key, unpack(ARGV, i, math.min(i + 999, #ARGV)))
    end
  end
end
local remaining = redis.call('SCARD', KEYS[3]) + redis.call('SCARD', KEYS[4])
if remaining == 0 then
  redis.call('HDEL', KEYS[1], ARGV[2])
  redis.call('DEL', KEYS[2])
end
return {freed, remaining}
"""
)

# KEYS: holders, lease. ARGV: request_id, worker, epoch, lease_ms.
# An expired lease is final: the reaper may already have reclaimed the blocks.
RENEW_LEASE = (
    _PRELUDE
    + """
local held = redis.call('HGET', KEYS[1], ARGV[2])
if not held then
  return conflict('request ' .. ARGV[1] .. ': expected blocks held by worker ' .. ARGV[2] ..
    ', found none (released or reclaimed)')
end
if held ~= ARGV[3] then
  return conflict('request ' .. ARGV[1] .. ': stale epoch for worker ' .. ARGV[2] ..
    ': expected ' .. held .. ', got ' .. ARGV[3])
end
if redis.call('PEXPIRE', KEYS[2], ARGV[4]) == 0 then
  return conflict('request ' .. ARGV[1] .. ': lease of worker ' .. ARGV[2] ..
    ' expected alive, found expired')
end
return 1
"""
)

# KEYS: holders, lease, target set, draft set. ARGV: worker.
# Returns {'gone'} | {'alive', pttl} | {'reclaimed', epoch, target ids, draft ids}.
REAP = (
    _PRELUDE
    + """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then
  return {'gone'}
end
local pttl = redis.call('PTTL', KEYS[2])
if pttl ~= -2 then
  return {'alive', pttl}
end
local target = redis.call('SMEMBERS', KEYS[3])
local draft = redis.call('SMEMBERS', KEYS[4])
redis.call('DEL', KEYS[3], KEYS[4])
redis.call('HDEL', KEYS[1], ARGV[1])
return {'reclaimed', held, target, draft}
"""
)

# Read-only. KEYS: holders, lease, target set, draft set, record. ARGV: worker.
# Returns {epoch or false, pttl, target ids, draft ids, request state or false}.
READ_HOLDING = """
return {
  redis.call('HGET', KEYS[1], ARGV[1]),
  redis.call('PTTL', KEYS[2]),
  redis.call('SMEMBERS', KEYS[3]),
  redis.call('SMEMBERS', KEYS[4]),
  redis.call('HGET', KEYS[5], 'state'),
}
"""

# KEYS: holdings index. ARGV: member, score. Removes the member only if its score is
# unchanged, so that a claim that raced the reaper keeps its index entry.
UNINDEX_IF_SCORE = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
"""

# KEYS: epoch counter. Never below the server's clock in microseconds, so that epochs keep
# growing across a Redis restart, empty or restored from a snapshot (whose counter is
# behind the epochs handed out since). Returns the new epoch.
NEXT_EPOCH = (
    _PRELUDE
    + """
local t = redis.call('TIME')
local now = t[1] .. string.format('%06d', tonumber(t[2]))
local epoch = redis.call('INCR', KEYS[1])
if epoch < tonumber(now) then
  redis.call('SET', KEYS[1], now)
  return tonumber(now)
end
return epoch
"""
)

# KEYS: generation (hash: id, started_ms, and each component's clock, tick:WORKER).
# ARGV: a fresh random id, the caller's worker id, the generation id and the tick the
# caller read last ('' and 0: none). The generation names one lifetime of the ledger's
# data: a new one begins when there is none (a new, restarted-empty or flushed Redis), or
# when the caller's generation is there but the caller's clock, which only the caller
# advances, is not past what it read last (the data went back in time: restored from a
# snapshot). Advances the caller's clock. Returns {id, started_ms, tick}.
JOIN_GENERATION = (
    _PRELUDE
    + """
local now = now_ms()
if redis.call('HSETNX', KEYS[1], 'id', ARGV[1]) == 1 then
  redis.call('HSET', KEYS[1], 'started_ms', now)
end
local tick = redis.call('HINCRBY', KEYS[1], 'tick:' .. ARGV[2], 1)
if redis.call('HGET', KEYS[1], 'id') == ARGV[3] and tick <= tonumber(ARGV[4]) then
  redis.call('HSET', KEYS[1], 'id', ARGV[1], 'started_ms', now)
end
return {redis.call('HGET', KEYS[1], 'id'), redis.call('HGET', KEYS[1], 'started_ms'), tick}
"""
)

# KEYS: worker record. ARGV: worker, epoch, ttl_ms, field, value, ...
REGISTER_WORKER = (
    _PRELUDE
    + """
local cur = redis.call('HGET', KEYS[1], 'epoch')
if cur and tonumber(cur) > tonumber(ARGV[2]) then
  return conflict('worker ' .. ARGV[1] .. ': stale epoch: expected at least ' .. cur ..
    ', got ' .. ARGV[2])
end
local now = now_ms()
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'epoch', ARGV[2], 'registered_ms', now, 'heartbeat_ms', now,
  unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS: worker record. ARGV: worker, epoch, ttl_ms, field, value, ...
HEARTBEAT = (
    _PRELUDE
    + """
local cur = redis.call('HGET', KEYS[1], 'epoch')
if not cur then
  return conflict('worker ' .. ARGV[1] .. ': expected a registration, found none ' ..
    '(expired or Redis restarted): register again')
end
if cur ~= ARGV[2] then
  return conflict('worker ' .. ARGV[1] .. ': stale epoch: expected ' .. cur .. ', got ' ..
    ARGV[2])
end
redis.call('HSET', KEYS[1], 'heartbeat_ms', now_ms(), unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS: worker record. ARGV: worker, epoch. Returns 1 if removed, 0 if already gone.
DEREGISTER_WORKER = (
    _PRELUDE
    + """
local cur = redis.call('HGET', KEYS[1], 'epoch')
if not cur then
  return 0
end
if cur ~= ARGV[2] then
  return conflict('worker ' .. ARGV[1] .. ': stale epoch: expected ' .. cur .. ', got ' ..
    ARGV[2])
end
return redis.call('DEL', KEYS[1])
"""
)
