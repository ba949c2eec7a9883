"""`cancel`: take a partition's queued jobs out of their queues; jobs in flight finish.

A canceled job keeps its hash (status `canceled`, listed in the queue's CanceledJobRegistry, as
RQ's own cancel leaves it), so `enqueue` queues it again if wanted. One script per queue
(common/protocol/scripts.py `CANCEL_QUEUED`) rewrites the list once, atomically.
"""

from __future__ import annotations

from collections import Counter

from redis import Redis
from rq.queue import Queue

from common.protocol import scripts
from common.protocol.keys import ALL_QUEUES
from common.protocol.serializer import PlainPickle
from producer.console.census import PartitionResolver, recorded_partitions


def cancel_queued(connection: Redis, partitions: list[str]) -> Counter[str]:
    """Cancel the queued jobs of `partitions`; how many per partition."""
    script = connection.register_script(scripts.CANCEL_QUEUED)
    resolver = PartitionResolver(connection, set(recorded_partitions(connection)) | set(partitions))
    canceled: Counter[str] = Counter()
    for name in ALL_QUEUES:
        queue = Queue(name, connection=connection, serializer=PlainPickle)
        listed = {item.decode() for item in connection.lrange(queue.key, 0, -1)}
        partition_of = resolver.resolve(listed)
        doomed = sorted(job_id for job_id, partition in partition_of.items() if partition in partitions)
        if not doomed:
            continue
        keys = [queue.key, queue.canceled_job_registry.key]
        for job_id in script(keys=keys, args=doomed):
            canceled[partition_of[job_id.decode()]] += 1
    return canceled
