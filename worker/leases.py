"""The Redis side of a job's life in the fleet: claim, lease renewal, requeue and reaping.

Each step is one Lua script (common/protocol/scripts.py), so that no job is ever half-claimed or
half-requeued, and each reads Redis's own clock, so that workers on hosts whose clocks disagree still
agree on when a lease lapses.

A claimed job is `started`, listed in its queue's StartedJobRegistry (where RQ's tools see it, never as
lapsed) and in the fleet's lease set, scored by when its lease lapses. The lease set doubles as the
fleet-wide semaphore: its live members are the jobs in flight in every worker on every host. A worker
renews its leases on each heartbeat; when it dies they lapse, and once one has stayed lapsed a whole lease,
any live worker's reaper puts its job back at the front of its queue. The sample's generation lock follows
the same lease.
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

from common.protocol import scripts
from common.protocol.keys import (
    PROBATION,
    PROBATION_KEY,
    PROBATION_QUEUE_KEY,
    generation_lock_key,
    lapsed_key,
    lease_key,
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
    # Another execution took the generation lock from this one (the lock key vanished: Redis restarted or failed
    # over), so this one stops and leaves the sample to it.
    lost: bool = False
    # A probation job's claim (worker/probation.py): whether no other was running, its turn, the cap's epoch.
    alone: bool = False
    turn: int = 0
    epoch: int = 0

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
        self._claim = connection.register_script(scripts.CLAIM)
        self._renew = connection.register_script(scripts.RENEW)
        self._lock = connection.register_script(scripts.LOCK)
        self._finish = connection.register_script(scripts.FINISH)
        self._reap = connection.register_script(scripts.REAP)

    def claim(self, lease: Lease, cap: int) -> dict[bytes, bytes] | None:
        """Claim the next job of the lease's queue: its hash, or None when the queue is empty, the fleet full, or
        (for another queue than probation) probation busy."""
        keys = [lease.queue.key, lease.queue.started_job_registry.key, lease_key(lease.queue.name)]
        keys += [PROBATION_QUEUE_KEY, lease_key(PROBATION), PROBATION_KEY]
        args = [self.lease_ttl, lease.execution_id, lease.owner, utcformat(lease.started_at), cap, lease.worker_name]
        reply = self._claim(keys=keys, args=[*args, int(lease.queue.name == PROBATION)])
        if not reply:
            return None
        job_id, locked, alone, turn, epoch, *fields = reply
        lease.job_id, lease.locked = job_id.decode(), bool(locked)
        lease.alone, lease.turn, lease.epoch = bool(alone), int(turn), int(epoch)
        return dict(zip(fields[::2], fields[1::2], strict=True))

    def renew(self, pipeline: Pipeline, lease: Lease) -> None:
        """Queue the renewal of `lease` on `pipeline`; its reply is 1 while the lock is still the lease's."""
        keys = [
            lease.queue.started_job_registry.key,
            lease.lock,
            lease_key(lease.queue.name),
            lapsed_key(lease.queue.name),
        ]
        args = [lease.member, lease.owner, self.lease_ttl, int(lease.locked)]
        self._renew(keys=keys, args=args, client=pipeline)

    def take_lock(self, lease: Lease) -> bool:
        lease.locked = bool(self._lock(keys=[lease.lock], args=[lease.owner, self.lease_ttl]))
        return lease.locked

    def finish(self, client: Pipeline | Redis, lease: Lease, requeue: bool = False) -> None:
        """Drop the lease and its lock; with `requeue`, put a job still `started` back at the front of its queue."""
        keys = [lease.queue.started_job_registry.key, lease.lock, Job.key_for(lease.job_id), lease.queue.key]
        keys += [lease_key(lease.queue.name), lapsed_key(lease.queue.name)]
        args = [lease.member, lease.owner, int(requeue), lease.job_id, utcformat(datetime.now(UTC))]
        self._finish(keys=keys, args=args, client=client)

    def reap(self, queue: Queue) -> int:
        """Requeue the jobs of `queue` whose lease stayed lapsed a whole lease (their worker died); how many."""
        keys = [queue.started_job_registry.key, queue.key, lease_key(queue.name), lapsed_key(queue.name)]
        return int(self._reap(keys=keys, args=[utcformat(datetime.now(UTC)), self.lease_ttl]))
