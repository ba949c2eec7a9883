"""Every Lua script that changes a job's state, with the keys and arguments it takes (KEYS, ARGV).

Each runs atomically in Redis, so a job is never half-claimed, half-requeued or pushed twice, and the ones
that time leases read Redis's own clock, so that workers on hosts whose clocks disagree still agree on when a
lease lapses. Job hashes are built from job IDs inside the scripts, as RQ's own scripts do.
"""

from __future__ import annotations

from common.protocol.keys import JOB_KEY_PREFIX, LOCK_PREFIX

# Producer: one queued job per pending prompt, however often and however many producers run.
# KEYS: job hash, queue list, RQ's set of queues, the finished and canceled registries, then every
# queue's failed registry. ARGV: job ID, then the job hash as field, value, ...
# Returns the status that made it skip the job, or "enqueued". A failed job in no failed registry is
# lost (e.g. RQ's own requeue interrupted between its steps): retry-failed cannot see it, so it is
# created and queued again.
ENQUEUE = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'queued' or status == 'started' or status == 'scheduled' or status == 'deferred' then
    return status
end
if status == 'failed' then
    for i = 6, #KEYS do
        if redis.call('ZSCORE', KEYS[i], ARGV[1]) then
            return status
        end
    end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('SADD', KEYS[3], KEYS[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 'enqueued'
"""


# Console: retry-failed puts a failed job back in its queue, once however many retries run at once.
# KEYS: failed registry, job hash, queue list, RQ's set of queues.
# ARGV: job ID, enqueued_at, the retries a new job gets.
# Returns "requeued", "gone" (the job expired from Redis: its registry entry is dropped), or the
# status that made it leave the job alone (another retry, or an enqueue, queued it first).
REQUEUE_FAILED = """
local status = redis.call('HGET', KEYS[2], 'status')
if not status then
    redis.call('ZREM', KEYS[1], ARGV[1])
    return 'gone'
end
if status ~= 'failed' then
    return status
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'status', 'queued', 'enqueued_at', ARGV[2], 'started_at', '', 'ended_at', '')
-- Whatever of its retry budget (REQUEUES_AFTER_WORKER_DEATH) was spent, a retried job starts with all of it.
if redis.call('HEXISTS', KEYS[2], 'retries_left') == 1 then
    redis.call('HSET', KEYS[2], 'retries_left', ARGV[3])
end
-- Nor has it crashed the server yet, as far as probation counts (worker/probation.py).
redis.call('HDEL', KEYS[2], 'fleet_crashes', 'fleet_crash_turn')
-- The failed registry set the job to expire with its entry; a queued job must not.
redis.call('PERSIST', KEYS[2])
redis.call('SADD', KEYS[4], KEYS[3])
redis.call('RPUSH', KEYS[3], ARGV[1])
return 'requeued'
"""


# Console: cancel takes a partition's queued jobs out of their queue. Removing IDs one LREM at a time costs a
# pass over the whole list each, so the list is rewritten once; a worker claims either before or not at all.
# KEYS: queue list, canceled registry. ARGV: the job IDs to cancel.
# Returns the IDs canceled. An ID of theirs whose job is no longer `queued` is a stale entry: dropped too.
CANCEL_QUEUED = (
    """
local doomed = {}
for i = 1, #ARGV do doomed[ARGV[i]] = true end
local kept, canceled = {}, {}
local dropped = 0
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
    if doomed[id] then
        dropped = dropped + 1
        local key = '"""
    + JOB_KEY_PREFIX
    + """' .. id
        if redis.call('HGET', key, 'status') == 'queued' then
            redis.call('HSET', key, 'status', 'canceled')
            redis.call('ZADD', KEYS[2], '+inf', id)
            canceled[#canceled + 1] = id
        end
    else
        kept[#kept + 1] = id
    end
end
if dropped > 0 then
    redis.call('DEL', KEYS[1])
    for i = 1, #kept, 5000 do
        redis.call('RPUSH', KEYS[1], unpack(kept, i, math.min(i + 4999, #kept)))
    end
end
return canceled
"""
)


# Workers: claim, lease renewal, the generation lock, finishing or requeueing an execution, reaping.
#
# A claimed execution is listed twice under the member `<job id>:<execution id>`: in its queue's
# StartedJobRegistry, scored +inf, so that RQ's own cleanup (run by `rq info` and rq-dashboard, on whatever
# host and clock) never takes it for lapsed; and in the fleet's lease set (`lease_key`), scored by when its
# lease lapses on Redis's clock, which the fleet-wide cap counts and the reaper reads. A lapsed lease is
# only marked at first (`lapsed_key`), and reaped if it is still lapsed a whole lease later: a Redis that
# stalled for any length of time leaves every lease lapsed when it answers again, and live workers renew
# theirs well within a lease.

# Lua: the current time from Redis, in seconds.
_NOW = "local clock = redis.call('TIME')\nlocal now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000\n"

# Pop the next job that is really waiting and mark it started, unless the fleet's cap is reached. An
# ID whose job is missing, or no longer `queued` (pushed twice, finished or canceled meanwhile), is
# dropped. Takes the sample's generation lock when free. While probation has jobs waiting or running, no other
# queue's job is claimed, and probation's cap is its own (worker/probation.py). Returns the job ID, 1 if the
# lock was taken, then, for probation, 1 if no other probation job was running, its turn and the cap's epoch
# (zeros otherwise), then the job hash, so that no second round trip fetches it.
# KEYS: queue list, started registry, lease set, probation list, probation lease set, probation hash.
# ARGV: lease seconds, execution ID, lock owner, RQ timestamp, cap, worker name, 1 if the queue is probation.
CLAIM = (
    _NOW
    + """
local cap = tonumber(ARGV[5])
local probation = ARGV[7] == '1'
if probation then
    cap = tonumber(redis.call('HGET', KEYS[6], 'cap') or '1')
elseif redis.call('LLEN', KEYS[4]) > 0 or redis.call('ZCOUNT', KEYS[5], now, '+inf') > 0 then
    return false
end
local running = redis.call('ZCOUNT', KEYS[3], now, '+inf')
if running >= cap then
    return false
end
while true do
    local job_id = redis.call('LPOP', KEYS[1])
    if not job_id then
        return false
    end
    local job_key = '"""
    + JOB_KEY_PREFIX
    + """' .. job_id
    if redis.call('HGET', job_key, 'status') == 'queued' then
        redis.call('HSET', job_key, 'status', 'started', 'worker_name', ARGV[6],
                   'started_at', ARGV[4], 'last_heartbeat', ARGV[4])
        local member = job_id .. ':' .. ARGV[2]
        redis.call('ZADD', KEYS[2], '+inf', member)
        redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), member)
        local lock = redis.call('SET', '"""
    + LOCK_PREFIX
    + """' .. job_id, ARGV[3], 'NX', 'PX', math.floor(tonumber(ARGV[1]) * 1000))
        local alone, turn, epoch = 0, 0, 0
        if probation then
            alone = running == 0 and 1 or 0
            turn = redis.call('HINCRBY', KEYS[6], 'turn', 1)
            epoch = tonumber(redis.call('HGET', KEYS[6], 'epoch') or '0')
        end
        local job = redis.call('HGETALL', job_key)
        table.insert(job, 1, epoch)
        table.insert(job, 1, turn)
        table.insert(job, 1, alone)
        table.insert(job, 1, lock and 1 or 0)
        table.insert(job, 1, job_id)
        return job
    end
end
"""
)

# Extend a job's lease and its lock, re-creating them (and its registry entry) if Redis lost them; never
# take a lock another execution holds. An execution that held the lock and finds another's has lost the sample
# to it: it is not renewed (its worker stops it and ends it), nor re-created if it has ended meanwhile. Returns
# 1 while the lock is this execution's.
# KEYS: started registry, lock, lease set, lapsed marks. ARGV: member, lock owner, lease seconds, 1 if the
# execution held the lock.
RENEW = (
    _NOW
    + """
local holder = redis.call('GET', KEYS[2])
if ARGV[4] == '1' and holder ~= false and holder ~= ARGV[2] then
    return 0
end
redis.call('ZADD', KEYS[1], '+inf', ARGV[1])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
if holder == false or holder == ARGV[2] then
    redis.call('SET', KEYS[2], ARGV[2], 'PX', math.floor(tonumber(ARGV[3]) * 1000))
    return 1
end
return 0
"""
)

# Take a sample's generation lock if it is free, or already this owner's (a renewal may have taken it for
# a waiting execution). KEYS: lock. ARGV: lock owner, lease seconds.
LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return 1
end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', math.floor(tonumber(ARGV[2]) * 1000)) and 1 or 0
"""

# Lua: drop the execution's registry member, lease and lapse mark, and its lock if still its own.
# KEYS[1]: started registry, KEYS[2]: lock, KEYS[5]: lease set, KEYS[6]: lapsed marks. ARGV[1]: member,
# ARGV[2]: lock owner.
_END_EXECUTION = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
if redis.call('GET', KEYS[2]) == ARGV[2] then
    redis.call('DEL', KEYS[2])
end
"""

# End an execution: drop its registry member, lease and lock (if still its own). Used after the result is
# recorded, and to requeue: with ARGV[3] = 1 a job still `started` goes back to the front of its queue.
# KEYS: started registry, lock, job hash, queue list, lease set, lapsed marks. ARGV: member, lock owner,
# requeue, job ID, RQ timestamp.
FINISH = (
    _END_EXECUTION
    + """
if ARGV[3] == '1' and redis.call('HGET', KEYS[3], 'status') == 'started' then
    redis.call('HSET', KEYS[3], 'status', 'queued', 'enqueued_at', ARGV[5])
    redis.call('LPUSH', KEYS[4], ARGV[4])
    return 1
end
return 0
"""
)

# Mark the leases that lapsed, and put back at the front of their queue the jobs whose lease has stayed
# lapsed for ARGV[2] seconds since it was marked (their worker is gone), spending none of their retries. A
# member whose job moved on (finished, failed, gone) is only dropped. Returns how many were requeued.
# KEYS: started registry, queue list, lease set, lapsed marks. ARGV: RQ timestamp, seconds to wait.
REAP = (
    _NOW
    + """
local requeued = 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 1000)) do
    local marked = redis.call('HGET', KEYS[4], member)
    if not marked then
        redis.call('HSET', KEYS[4], member, now)
    elseif now - tonumber(marked) >= tonumber(ARGV[2]) then
        redis.call('ZREM', KEYS[1], member)
        redis.call('ZREM', KEYS[3], member)
        redis.call('HDEL', KEYS[4], member)
        local job_id = string.match(member, '^(.*):[^:]*$') or member
        local job_key = '"""
    + JOB_KEY_PREFIX
    + """' .. job_id
        if redis.call('HGET', job_key, 'status') == 'started' then
            redis.call('HSET', job_key, 'status', 'queued', 'enqueued_at', ARGV[1])
            redis.call('LPUSH', KEYS[2], job_id)
            requeued = requeued + 1
        end
    end
end
return requeued
"""
)


# Probation (worker/probation.py): the jobs in flight when a server went down run again in ever smaller groups,
# with nothing else in flight, until one runs alone when the server goes down: that one crashes it.

# Send a job whose request was in flight when its server went down to the back of probation, as FINISH
# requeues; the first to arrive in an idle probation sets its cap. A job no longer `started` stays as it is.
# KEYS: started registry, lock, job hash, probation list, lease set, lapsed marks, probation lease set,
# probation hash. ARGV: member, lock owner, job ID, RQ timestamp, probation's first cap.
SUSPECT = (
    _NOW
    + _END_EXECUTION
    + """
if redis.call('HGET', KEYS[3], 'status') ~= 'started' then
    return 0
end
if redis.call('LLEN', KEYS[4]) == 0 and redis.call('ZCOUNT', KEYS[7], now, '+inf') == 0 then
    redis.call('HSET', KEYS[8], 'cap', ARGV[5], 'streak', 0, 'hold', 0)
    redis.call('HINCRBY', KEYS[8], 'epoch', 1)
end
redis.call('HSET', KEYS[3], 'status', 'queued', 'enqueued_at', ARGV[4])
redis.call('RPUSH', KEYS[4], ARGV[3])
return 1
"""
)

# A probation job's server went down while it ran. The first of the group to say so cuts the cap to a quarter
# (those claimed at the same epoch were running together), and holds it there until as many jobs as the group
# that crashed have passed: the smaller groups split that one, rather than grow back into it. Returns how many
# times the job has now been running alone when its server went down (its hash's `fleet_crashes`), or 0 if it
# was not alone: it was, if no other probation job was running when it was claimed and none has been claimed
# since.
# KEYS: probation hash, job hash. ARGV: the job's turn, 1 if it was claimed alone, its epoch.
CRASHED = """
local cap = tonumber(redis.call('HGET', KEYS[1], 'cap') or '1')
if tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') == tonumber(ARGV[3]) then
    redis.call('HSET', KEYS[1], 'cap', math.max(1, math.floor(cap / 4)), 'streak', 0, 'hold', cap)
    redis.call('HINCRBY', KEYS[1], 'epoch', 1)
end
if ARGV[2] == '1' and tonumber(redis.call('HGET', KEYS[1], 'turn')) == tonumber(ARGV[1]) then
    -- Once per claim, though this script runs again when its reply was lost.
    if redis.call('HGET', KEYS[2], 'fleet_crash_turn') ~= ARGV[1] then
        redis.call('HSET', KEYS[2], 'fleet_crash_turn', ARGV[1])
        redis.call('HINCRBY', KEYS[2], 'fleet_crashes', 1)
    end
    return tonumber(redis.call('HGET', KEYS[2], 'fleet_crashes'))
end
return 0
"""

# A probation job finished: after as many in a row as the cap (and as the group whose crash it holds for),
# the cap doubles, up to the fleet's caps. KEYS: probation hash. ARGV: the largest cap.
PASSED = """
local cap = tonumber(redis.call('HGET', KEYS[1], 'cap') or '1')
local hold = tonumber(redis.call('HGET', KEYS[1], 'hold') or '0')
if redis.call('HINCRBY', KEYS[1], 'streak', 1) >= math.max(cap, hold) then
    redis.call('HSET', KEYS[1], 'cap', math.min(cap * 2, tonumber(ARGV[1])), 'streak', 0, 'hold', 0)
end
"""
