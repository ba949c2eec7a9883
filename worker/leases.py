"""The Redis side of a job's life in the fleet: claim, lease renewal, requeue and reaping.

Each step is one Lua script, so that no job is ever half-claimed or half-requeued, and each reads
Redis's own clock, so that workers on hosts whose clocks disagree still agree on when a lease lapses.

A claimed job is `started` and listed in its queue's StartedJobRegistry under the member
`<job id>:<execution id>`, scored by when its lease lapses. The registry doubles as the fleet-wide
semaphore: its members with a live lease are the jobs in flight in every worker on every host. A
worker renews its leases on each heartbeat; when it dies they lapse, and any live worker's reaper puts
the jobs back at the front of their queues. The sample's generation lock follows the same lease.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

from redis import Redis
from redis.client import Pipeline
from rq import Queue
from rq.job import Job
from rq.utils import utcformat

from common.keys import LOCK_PREFIX, generation_lock_key

# Lua: the current time from Redis, in seconds.
_NOW = "local clock = redis.call('TIME')\nlocal now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000\n"

# Pop the next job that is really waiting and mark it started, unless the fleet's cap is reached. An
# ID whose job is missing, or no longer `queued` (pushed twice, finished or canceled meanwhile), is
# dropped. Takes the sample's generation lock when free. Returns the job ID, 1 if the lock was taken,
# then the job hash, so that no second round trip fetches it.
# KEYS: queue list, started registry.
# ARGV: lease seconds, execution ID, lock owner, RQ timestamp, cap, worker name.
# Job keys are built here from the popped ID, as RQ's own scripts do.
CLAIM_SCRIPT = (
    _NOW
    + """
if redis.call('ZCOUNT', KEYS[2], now, '+inf') >= tonumber(ARGV[5]) then
    return false
end
while true do
    local job_id = redis.call('LPOP', KEYS[1])
    if not job_id then
        return false
    end
    local job_key = 'rq:job:' .. job_id
    if redis.call('HGET', job_key, 'status') == 'queued' then
        redis.call('HSET', job_key, 'status', 'started', 'worker_name', ARGV[6],
                   'started_at', ARGV[4], 'last_heartbeat', ARGV[4])
        redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), job_id .. ':' .. ARGV[2])
        local lock = redis.call('SET', '"""
    + LOCK_PREFIX
    + """' .. job_id, ARGV[3], 'NX', 'PX', math.floor(tonumber(ARGV[1]) * 1000))
        local job = redis.call('HGETALL', job_key)
        table.insert(job, 1, lock and 1 or 0)
        table.insert(job, 1, job_id)
        return job
    end
end
"""
)

# Extend a job's lease and its lock, re-creating them if Redis lost them; never take a lock another
# execution holds. Returns 1 while the lock is this execution's.
# KEYS: started registry, lock. ARGV: registry member, lock owner, lease seconds.
RENEW_SCRIPT = (
    _NOW
    + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
local holder = redis.call('GET', KEYS[2])
if holder == false or holder == ARGV[2] then
    redis.call('SET', KEYS[2], ARGV[2], 'PX', math.floor(tonumber(ARGV[3]) * 1000))
    return 1
end
return 0
"""
)

# Take a sample's generation lock if it is free. KEYS: lock. ARGV: lock owner, lease seconds.
LOCK_SCRIPT = """
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', math.floor(tonumber(ARGV[2]) * 1000)) and 1 or 0
"""

# End an execution: drop its registry member and its lock (if still its own). Used after the result is
# recorded, and to requeue: with ARGV[3] = 1 a job still `started` goes back to the front of its queue.
# KEYS: started registry, lock, job hash, queue list. ARGV: registry member, lock owner, requeue, job ID,
# RQ timestamp.
FINISH_SCRIPT = """
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('GET', KEYS[2]) == ARGV[2] then
    redis.call('DEL', KEYS[2])
end
if ARGV[3] == '1' and redis.call('HGET', KEYS[3], 'status') == 'started' then
    redis.call('HSET', KEYS[3], 'status', 'queued', 'enqueued_at', ARGV[5])
    redis.call('LPUSH', KEYS[4], ARGV[4])
    return 1
end
return 0
"""

# Put the jobs whose lease lapsed back at the front of their queue, spending none of their retries.
# A member whose job moved on (finished, failed, gone) is only dropped. Returns how many were requeued.
# KEYS: started registry, queue list. ARGV: RQ timestamp.
REAP_SCRIPT = (
    _NOW
    + """
local requeued = 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1000)) do
    redis.call('ZREM', KEYS[1], member)
    local job_id = string.match(member, '^(.*):[^:]*$') or member
    local job_key = 'rq:job:' .. job_id
    if redis.call('HGET', job_key, 'status') == 'started' then
        redis.call('HSET', job_key, 'status', 'queued', 'enqueued_at', ARGV[1])
        redis.call('LPUSH', KEYS[2], job_id)
        requeued = requeued + 1
    end
end
return requeued
"""
)


@dataclass
class Lease:
    """One execution's hold on a job: its registry member, scored by its lease, and the sample's lock."""

    queue: Queue
    worker_name: str
    execution_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    job_id: str = ""
    locked: bool = False

    @property
    def member(self) -> str:
        return f"{self.job_id}:{self.execution_id}"

    @property
    def owner(self) -> str:
        """The lock's value: this execution, so that a second execution in the same worker is another owner."""
        return f"{self.worker_name}:{self.execution_id}"

    @property
    def lock(self) -> str:
        return generation_lock_key(self.job_id)


class Leases:
    def __init__(self, connection: Redis, lease_ttl: float) -> None:
        self.connection = connection
        self.lease_ttl = lease_ttl
        self._claim = connection.register_script(CLAIM_SCRIPT)
        self._renew = connection.register_script(RENEW_SCRIPT)
        self._lock = connection.register_script(LOCK_SCRIPT)
        self._finish = connection.register_script(FINISH_SCRIPT)
        self._reap = connection.register_script(REAP_SCRIPT)

    def claim(self, lease: Lease, cap: int) -> dict[bytes, bytes] | None:
        """Claim the next job of the lease's queue: its hash, or None when the queue is empty or the fleet full."""
        keys = [lease.queue.key, lease.queue.started_job_registry.key]
        args = [self.lease_ttl, lease.execution_id, lease.owner, utcformat(lease.started_at), cap, lease.worker_name]
        reply = self._claim(keys=keys, args=args)
        if not reply:
            return None
        job_id, locked, *fields = reply
        lease.job_id, lease.locked = job_id.decode(), bool(locked)
        return dict(zip(fields[::2], fields[1::2], strict=True))

    def renew(self, pipeline: Pipeline, lease: Lease) -> None:
        """Queue the renewal of `lease` on `pipeline`; its reply is 1 while the lock is still the lease's."""
        keys = [lease.queue.started_job_registry.key, lease.lock]
        self._renew(keys=keys, args=[lease.member, lease.owner, self.lease_ttl], client=pipeline)

    def take_lock(self, lease: Lease) -> bool:
        lease.locked = bool(self._lock(keys=[lease.lock], args=[lease.owner, self.lease_ttl]))
        return lease.locked

    def finish(self, client: Pipeline | Redis, lease: Lease, requeue: bool = False) -> None:
        """Drop the lease and its lock; with `requeue`, put a job still `started` back at the front of its queue."""
        keys = [lease.queue.started_job_registry.key, lease.lock, Job.key_for(lease.job_id), lease.queue.key]
        args = [lease.member, lease.owner, int(requeue), lease.job_id, utcformat(datetime.now(UTC))]
        self._finish(keys=keys, args=args, client=client)

    def reap(self, queue: Queue) -> int:
        """Requeue the jobs of `queue` whose lease lapsed (their worker died); how many."""
        keys = [queue.started_job_registry.key, queue.key]
        return int(self._reap(keys=keys, args=[utcformat(datetime.now(UTC))]))
