"""`cancel`: take a partition's queued jobs out of their queues; jobs in flight finish.

A canceled job keeps its hash (status `canceled`, listed in the queue's CanceledJobRegistry, as
RQ's own cancel leaves it), so `enqueue` queues it again if wanted. Removing IDs from a queue one
LREM at a time costs a pass over the whole list each, so one script rewrites the list once, and
atomically: a worker claims either before the cancel or not at all.
"""

from __future__ import annotations

from collections import Counter

from redis import Redis
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from common.keys import QUEUES
from producer.census import PartitionResolver, recorded_partitions

# KEYS: queue list, canceled registry. ARGV: job key prefix, then the job IDs to cancel.
# Returns the IDs canceled. An ID of theirs whose job is no longer `queued` is a stale entry: dropped too.
CANCEL_SCRIPT = """
local doomed = {}
for i = 2, #ARGV do doomed[ARGV[i]] = true end
local kept, canceled = {}, {}
local dropped = 0
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
    if doomed[id] then
        dropped = dropped + 1
        local key = ARGV[1] .. id
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


def cancel_queued(connection: Redis, partitions: list[str]) -> Counter[str]:
    """Cancel the queued jobs of `partitions`; how many per partition."""
    script = connection.register_script(CANCEL_SCRIPT)
    resolver = PartitionResolver(connection, set(recorded_partitions(connection)) | set(partitions))
    canceled: Counter[str] = Counter()
    for name in QUEUES:
        queue = Queue(name, connection=connection, serializer=JSONSerializer)
        listed = {item.decode() for item in connection.lrange(queue.key, 0, -1)}
        partition_of = resolver.resolve(listed)
        doomed = sorted(job_id for job_id, partition in partition_of.items() if partition in partitions)
        if not doomed:
            continue
        keys = [queue.key, queue.canceled_job_registry.key]
        for job_id in script(keys=keys, args=[Job.redis_job_namespace_prefix, *doomed]):
            canceled[partition_of[job_id.decode()]] += 1
    return canceled
