"""Every name the fleet gives in Redis and the output store: queues, the job function, job IDs, keys and prefixes."""

from __future__ import annotations

import hashlib
import re

from rq.job import Job, JobStatus
from rq.queue import Queue

QUEUES = ("short", "long")
# The jobs that were in flight when a server went down wait in this queue, each still its own queue's job, and
# run in ever smaller groups with nothing else in flight until the one that crashes the server is found
# (worker/probation.py). FleetWorkers take from it before their other queues.
PROBATION = "probation"
# Every queue a job can wait or run in.
ALL_QUEUES = (*QUEUES, PROBATION)
PROBATION_QUEUE_KEY = Queue.redis_queue_namespace_prefix + PROBATION

# The only function a FleetWorker executes, whatever a job in Redis names.
JOB_FUNCTION = "worker.jobs.generate"
# How a job's description begins: "generate <partition>/<sample id>" names its sample exactly, as the readable
# part of its ID may not.
DESCRIPTION_PREFIX = "generate "

# RQ's job hashes, which the Lua scripts build from job IDs as RQ's own scripts do.
JOB_KEY_PREFIX = Job.redis_job_namespace_prefix
# A job in one of these states is someone's to finish: enqueue leaves it alone.
PENDING = {JobStatus.QUEUED, JobStatus.STARTED, JobStatus.SCHEDULED, JobStatus.DEFERRED}
# RQ's own cleanup (run by `rq info` and rq-dashboard) requeues a job whose lease lapsed by spending one
# retry; the fleet's reaper spends none, and generation failures are retried inside the worker. So every
# job is created with this many, and a retried failed job gets them all back.
REQUEUES_AFTER_WORKER_DEATH = 100

PREFIX = "fleet"
# One worker at a time reaps lapsed leases; the reaping is atomic, the lock only saves the others the work.
REAPER_LOCK = f"{PREFIX}:reaper"
DUPLICATES_KEY = f"{PREFIX}:stats:duplicates"
# A stream with one entry per committed sample (field `tokens`), capped, for throughput over recent minutes.
COMPLETIONS_KEY = f"{PREFIX}:completions"
COMPLETIONS_MAXLEN = 200_000
# A hash of running totals: `samples`, `tokens`, and `first_at` (UNIX time of the first commit).
TOTALS_KEY = f"{PREFIX}:stats:totals"

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def sample_key(sample_id: str | int) -> str:
    """The canonical text of a sample ID: 7 and "7" name the same sample."""
    return str(sample_id)


def job_id(partition: str, sample_id: str | int, version: str = "") -> str:
    """A deterministic RQ job ID for one version of one sample, readable and limited to RQ's `[A-Za-z0-9_-]`.

    The readable part is lossy (unsafe characters folded, long IDs cut), so a hash of the exact
    (partition, sample, version) keeps distinct samples apart. The version is a digest of what the sample is
    generated from (producer.prompts.prompt_version): a prompt edited between runs is another job, and its
    output another record. Without a version, the ID is the one jobs had before versions (still read).
    """
    key = sample_key(sample_id)
    material = f"{partition}\0{key}" + (f"\0{version}" if version else "")
    digest = hashlib.blake2b(material.encode(), digest_size=8).hexdigest()
    return f"{readable_part(partition, sample_id)}--{digest}"


def readable_part(partition: str, sample_id: str | int) -> str:
    """How every job ID of a sample begins, whatever its version."""
    return _UNSAFE.sub("_", f"{partition}--{sample_key(sample_id)}")[:80]


def readable_part_of(job_id: str) -> str:
    """The `readable_part` a job ID begins with: what the IDs of every version of its sample share."""
    return job_id.rsplit("--", 1)[0]


# Held while a worker generates a sample, so that two workers never generate it at once.
LOCK_PREFIX = f"{PREFIX}:lock:"


def generation_lock_key(job: str) -> str:
    return f"{LOCK_PREFIX}{job}"


def lease_key(queue: str) -> str:
    """The leases of the executions of `queue`'s jobs, scored by when each lapses (common/protocol/scripts.py)."""
    return f"{PREFIX}:leases:{queue}"


def lapsed_key(queue: str) -> str:
    """When the reaper first saw each of `queue`'s lapsed leases: it reaps one that stays lapsed a lease longer."""
    return f"{PREFIX}:lapsed:{queue}"


# A hash of probation's state: `cap` (how many of its jobs may run at once), `streak` (successes at that cap),
# `hold` (the size of the group whose crash last cut the cap), `epoch` (bumped at each cut) and `turn` (a count
# of its claims).
PROBATION_KEY = f"{PREFIX}:probation"


def worker_state_key(worker_name: str) -> str:
    """A FleetWorker's own report, refreshed by its heartbeat and expiring with it (see worker.fleet)."""
    return f"{PREFIX}:worker:{worker_name}"


def hint_key(worker_name: str) -> str:
    """Set once a plain RQ worker has been told that a FleetWorker keeps many generations in flight."""
    return f"{PREFIX}:hinted:{worker_name}"


def partition_key(partition: str) -> str:
    """A hash per partition for status tooling: its totals (enqueue) and its count of committed samples (workers)."""
    return f"{PREFIX}:partition:{partition}"


def server_metrics_key(url: str) -> str:
    """A hash of the latest metrics of one SGLang server (parsed from its log by the supervisor)."""
    return f"{PREFIX}:server:{url}"


def job_id_prefix(partition: str) -> str:
    """How every `job_id` of `partition` begins. Prefixes of different partitions can overlap ("a", "a--b")."""
    return _UNSAFE.sub("_", f"{partition}--")[:80]
