"""`retry-failed`: put failed jobs back in their queues under their own IDs, once each.

RQ's FailedJobRegistry.requeue takes a job out of the registry (ZREM), saves it, then queues it, in
three steps: interrupted in between, it leaves a job `failed` that is in no registry and no queue.
Here one script per job does all of it, and only to a job still `failed`, so of two retries running
at once only one queues each job. A job whose sample was committed meanwhile (a duplicate generation
that failed after the first one succeeded) is not run again: its failed job is deleted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime

from redis import Redis
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.registry import FailedJobRegistry
from rq.utils import utcformat

from common.protocol import scripts
from common.protocol.keys import QUEUES, REQUEUES_AFTER_WORKER_DEATH
from common.protocol.serializer import PlainPickle
from common.store import OutputStore
from producer.console.causes import matches, read_failures
from producer.console.census import PartitionResolver, recorded_partitions


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
    requeue = connection.register_script(scripts.REQUEUE_FAILED)
    for name in QUEUES:
        queue = Queue(name, connection=connection, serializer=PlainPickle)
        registry = FailedJobRegistry(name, connection=connection, serializer=PlainPickle)
        job_ids = [item.decode() for item in connection.zrange(registry.key, 0, -1)]
        for failure in read_failures(connection, resolver.resolve(job_ids)):
            if (partitions and failure.partition not in partitions) or not matches(failure, cause):
                summary.left += 1
            elif store.has(failure.partition, failure.job_id):
                if _delete(connection, registry, failure.job_id):
                    summary.already_done += 1
                else:
                    summary.gone += 1
            else:
                keys = [registry.key, Job.key_for(failure.job_id), queue.key, Queue.redis_queues_keys]
                args = [failure.job_id, utcformat(datetime.now(UTC)), REQUEUES_AFTER_WORKER_DEATH]
                outcome = requeue(keys=keys, args=args).decode()
                if outcome == "requeued":
                    summary.retried[failure.partition] += 1
                elif outcome == "gone":
                    summary.gone += 1
    return summary


def _delete(connection: Redis, registry: FailedJobRegistry, job_id: str) -> bool:
    """Delete a failed job and its registry entry; False if the job had already expired from Redis."""
    try:
        job = Job.fetch(job_id, connection=connection, serializer=PlainPickle)
    except NoSuchJobError:
        registry.remove(job_id)
        return False
    job.delete()
    return True
