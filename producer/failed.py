"""`retry-failed`: put failed jobs back in their queues under their own IDs, once each.

RQ's FailedJobRegistry.requeue takes a job out of the registry with one ZREM before it queues it,
so of two retries running at once only one queues each job. A job whose sample was committed
meanwhile (a duplicate generation that failed after the first one succeeded) is not run again:
its failed job is deleted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from redis import Redis
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from common.keys import QUEUES
from common.store import OutputStore
from producer.census import PartitionResolver, recorded_partitions
from producer.failures import matches, read_failures


@dataclass
class RetrySummary:
    retried: Counter[str] = field(default_factory=Counter)  # per partition
    already_done: int = 0
    gone: int = 0  # listed as failed, but the job itself has expired from Redis
    left: int = 0  # failed jobs that --partition or --cause left alone


def retry_failed(
    connection: Redis, store: OutputStore, partitions: list[str] | None = None, cause: str | None = None
) -> RetrySummary:
    summary = RetrySummary()
    resolver = PartitionResolver(connection, set(recorded_partitions(connection)) | set(partitions or []))
    for queue in QUEUES:
        registry = FailedJobRegistry(queue, connection=connection, serializer=JSONSerializer)
        job_ids = [item.decode() for item in connection.zrange(registry.key, 0, -1)]
        for failure in read_failures(connection, resolver.resolve(job_ids)):
            if (partitions and failure.partition not in partitions) or not matches(failure, cause):
                summary.left += 1
                continue
            try:
                job = Job.fetch(failure.job_id, connection=connection, serializer=JSONSerializer)
            except NoSuchJobError:
                registry.remove(failure.job_id)
                summary.gone += 1
                continue
            if store.exists(failure.partition, job.id):
                job.delete()
                summary.already_done += 1
                continue
            try:
                registry.requeue(job)
            except InvalidJobOperation:
                continue  # another retry took it out of the registry first
            summary.retried[failure.partition] += 1
    return summary
