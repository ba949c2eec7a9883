"""Probation: finding the prompt that crashes the server without failing the prompts that ran beside it.

When a server goes down, every request in flight on it fails alike, and nothing tells the prompt that
crashed it from its neighbours. So none is blamed at once: each job whose request was in flight moves to the
`probation` queue, spending none of its attempts, and while probation has jobs waiting or running, workers
take no other job. Probation first runs them all again at once (most crashes are not a prompt's doing, and
the fleet is back to full flight at once); each time the server goes down under probation's jobs, its cap is
cut to a quarter, and after as many successes in a row as the cap it doubles, so the innocent drain quickly.
A job running alone when its server goes down is what crashes it: after FLEET_MAX_CRASHES_ALONE such crashes
its job fails, saying so, and nothing else does.

The state is one Redis hash (PROBATION_KEY) changed only by Lua scripts (common/protocol/scripts.py), so
workers on every host agree on it.
"""

from __future__ import annotations

from redis import Redis
from redis.client import Pipeline
from rq.job import Job
from rq.utils import now, utcformat

from common.protocol import scripts
from common.protocol.keys import PROBATION, PROBATION_KEY, PROBATION_QUEUE_KEY, lapsed_key, lease_key
from common.settings import Settings
from worker.leases import Lease


class Probation:
    def __init__(self, connection: Redis, settings: Settings) -> None:
        self.largest_cap = settings.concurrency(PROBATION)
        self._suspect = connection.register_script(scripts.SUSPECT)
        self._crashed = connection.register_script(scripts.CRASHED)
        self._passed = connection.register_script(scripts.PASSED)

    def suspect(self, lease: Lease) -> None:
        """Move the job of `lease`, whose request was in flight when its server went down, to probation's back."""
        queue = lease.queue
        keys = [queue.started_job_registry.key, lease.lock, Job.key_for(lease.job_id), PROBATION_QUEUE_KEY]
        keys += [lease_key(queue.name), lapsed_key(queue.name), lease_key(PROBATION), PROBATION_KEY]
        args = [lease.member, lease.owner, lease.job_id, utcformat(now()), self.largest_cap]
        self._suspect(keys=keys, args=args)

    def crashed(self, lease: Lease) -> int:
        """A probation job's server went down: how many times it has now done so with this job running alone."""
        keys = [PROBATION_KEY, Job.key_for(lease.job_id)]
        return int(self._crashed(keys=keys, args=[lease.turn, int(lease.alone), lease.epoch]))

    def passed(self, pipeline: Pipeline) -> None:
        """Count a probation job that finished, on the pipeline that records it."""
        self._passed(keys=[PROBATION_KEY], args=[self.largest_cap], client=pipeline)
