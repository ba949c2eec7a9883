"""Where each generation job stands in RQ, by partition: queued, in flight, failed, finished lately.

Job IDs are read straight from RQ's queue lists and registries, a few round trips whatever the
number of jobs, and attributed to partitions by the prefix `common.protocol.keys.job_id` gives them. An ID
whose prefix fits several known partitions, or none, is attributed by its job's description,
which the producer writes as `generate <partition>/<sample id>` (a partition, a file stem, holds
no `/`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from redis import Redis
from rq.job import Job
from rq.queue import Queue

from common.protocol.keys import ALL_QUEUES, DESCRIPTION_PREFIX, job_id_prefix, lease_key, partition_key
from common.protocol.serializer import PlainPickle

# Jobs that no known partition claims: not the producer's, or from a partition whose totals are gone.
UNKNOWN = "(unknown)"


@dataclass
class Census:
    """Job IDs per partition in each state; a job listed twice (a stale queue entry) is in each set once."""

    queued: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    in_flight: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    failed: defaultdict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    finished_recently: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # In-flight jobs whose lease ran out: their worker died, and only a live worker's maintenance requeues them.
    lapsed_leases: int = 0


def recorded_partitions(connection: Redis) -> dict[str, dict[str, str]]:
    """The partitions the producer has enqueued, with the totals it recorded (`common.protocol.keys.partition_key`)."""
    prefix = partition_key("")
    names = sorted(key.decode().removeprefix(prefix) for key in connection.scan_iter(match=prefix + "*", count=1000))
    with connection.pipeline(transaction=False) as pipeline:
        for name in names:
            pipeline.hgetall(partition_key(name))
        recorded = pipeline.execute()
    return {
        name: {key.decode(): value.decode() for key, value in fields.items()}
        for name, fields in zip(names, recorded, strict=True)
    }


class PartitionResolver:
    """Maps job IDs to partition names."""

    def __init__(self, connection: Redis, partitions: Iterable[str]) -> None:
        self.connection = connection
        self.by_prefix: defaultdict[str, set[str]] = defaultdict(set)
        for name in partitions:
            self.by_prefix[job_id_prefix(name)].add(name)
        self.lengths = sorted({len(prefix) for prefix in self.by_prefix})

    def resolve(self, job_ids: Iterable[str]) -> dict[str, str]:
        resolved: dict[str, str] = {}
        unclear: list[str] = []
        for identifier in job_ids:
            matches = set().union(*(self.by_prefix.get(identifier[:length], ()) for length in self.lengths))
            if len(matches) == 1:
                resolved[identifier] = matches.pop()
            else:
                unclear.append(identifier)
        with self.connection.pipeline(transaction=False) as pipeline:
            for identifier in unclear:
                pipeline.hget(Job.key_for(identifier), "description")
            descriptions = pipeline.execute()
        for identifier, description in zip(unclear, descriptions, strict=True):
            resolved[identifier] = _partition_of(description.decode() if description else "")
        return resolved


def take_census(connection: Redis, resolver: PartitionResolver, now: float, window: float, result_ttl: int) -> Census:
    """Read every queue and registry at once; `window` seconds back counts as finished lately.

    A finished job sits in its FinishedJobRegistry scored by when its result expires, `result_ttl`
    after it finished, so the recent ones are those scored above `now + result_ttl - window`.
    """
    with connection.pipeline(transaction=False) as pipeline:
        for name in ALL_QUEUES:
            queue = Queue(name, connection=connection, serializer=PlainPickle)
            pipeline.lrange(queue.key, 0, -1)
            pipeline.zrange(queue.started_job_registry.key, 0, -1)
            pipeline.zcount(lease_key(name), "-inf", now)
            pipeline.zrange(queue.failed_job_registry.key, 0, -1)
            # RQ scores in whole seconds: round down, or a job finished in this very second is missed.
            pipeline.zrangebyscore(queue.finished_job_registry.key, math.floor(now - window) + result_ttl, "+inf")
        replies = pipeline.execute()

    queued: set[str] = set()
    in_flight: set[str] = set()
    failed: set[str] = set()
    finished: list[str] = []
    lapsed = 0
    for index in range(0, len(replies), 5):
        listed, started, lapsed_here, failures, recent = replies[index : index + 5]
        queued.update(item.decode() for item in listed)
        # StartedJobRegistry entries are `<job id>:<execution id>`; job IDs hold no colon.
        in_flight.update(entry.decode().split(":", 1)[0] for entry in started)
        lapsed += lapsed_here
        failed.update(item.decode() for item in failures)
        if result_ttl > 0:
            finished.extend(item.decode() for item in recent)

    partition_of = resolver.resolve(queued | in_flight | failed | set(finished))
    census = Census(lapsed_leases=lapsed)
    for identifier in in_flight:
        census.in_flight[partition_of[identifier]].add(identifier)
    for identifier in failed - in_flight:
        census.failed[partition_of[identifier]].add(identifier)
    for identifier in queued - in_flight - failed:
        census.queued[partition_of[identifier]].add(identifier)
    for identifier in finished:
        census.finished_recently[partition_of[identifier]] += 1
    return census


def _partition_of(description: str) -> str:
    if not description.startswith(DESCRIPTION_PREFIX) or "/" not in description:
        return UNKNOWN
    return description.removeprefix(DESCRIPTION_PREFIX).split("/", 1)[0]
