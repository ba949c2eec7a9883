"""RQ's own records of how a job ended, written as RQ's worker writes them, on a pipeline the caller executes.

A FleetWorker runs many jobs at once in one process, so it cannot use RQ's `Worker.handle_job_success` and
`handle_job_failure`, which assume one job and one work horse. These write the same status, result,
registry entries and expiry, so that `rq info`, rq-dashboard and `Job.fetch` see the job as RQ would.
"""

from __future__ import annotations

import time
from datetime import datetime

from redis.client import Pipeline
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.results import Result
from rq.utils import utcformat

from common.protocol.keys import COMPLETIONS_KEY, COMPLETIONS_MAXLEN, DUPLICATES_KEY, TOTALS_KEY, partition_key
from common.records import GenerationResult


def record_success(
    pipeline: Pipeline,
    job: Job,
    result: GenerationResult,
    ttl: int,
    worker_name: str,
    execution_id: str,
    started_at: datetime,
    ended_at: datetime,
) -> None:
    """What RQ's Job._handle_success does, less re-saving the whole job: its arguments are unchanged."""
    job.set_status(JobStatus.FINISHED, pipeline=pipeline)
    pipeline.hset(job.key, "ended_at", utcformat(ended_at))
    Result.create(
        job,
        Result.Type.SUCCESSFUL,
        ttl,
        return_value=result.model_dump(),
        worker_name=worker_name,
        pipeline=pipeline,
        execution_id=execution_id,
        execution_started_at=started_at,
        execution_ended_at=ended_at,
    )
    job.finished_job_registry.add(job, ttl, pipeline)
    job.cleanup(ttl, pipeline=pipeline, remove_from_queue=False)


def record_counts(pipeline: Pipeline, partition: str, result: GenerationResult) -> None:
    """The fleet's own figures of a finished generation: duplicates, throughput, totals, the partition's done."""
    if result.duplicate:
        pipeline.incr(DUPLICATES_KEY)
    if result.committed:
        tokens = result.completion_tokens
        pipeline.xadd(COMPLETIONS_KEY, {"tokens": tokens}, maxlen=COMPLETIONS_MAXLEN, approximate=True)
        pipeline.hincrby(TOTALS_KEY, "samples", 1)
        pipeline.hincrby(TOTALS_KEY, "tokens", tokens)
        pipeline.hsetnx(TOTALS_KEY, "first_at", time.time())
        pipeline.hincrby(partition_key(partition), "done", 1)


def record_failure(
    pipeline: Pipeline,
    job: Job,
    failure: str,
    worker_name: str,
    execution_id: str,
    started_at: datetime,
    ended_at: datetime,
) -> None:
    """The job failed: its status, and a failed Result carrying `failure` in its queue's FailedJobRegistry."""
    job.set_status(JobStatus.FAILED, pipeline=pipeline)
    job._handle_failure(
        failure,
        pipeline=pipeline,
        worker_name=worker_name,
        execution_id=execution_id,
        execution_started_at=started_at,
        execution_ended_at=ended_at,
    )


def record_unreadable(pipeline: Pipeline, queue: Queue, job_id: str, failure: str) -> None:
    """Fail a job whose hash RQ cannot read, by hand: RQ's own failure handling would try to re-save it."""
    pipeline.hset(Job.key_for(job_id), mapping={"status": JobStatus.FAILED, "exc_info": failure})
    pipeline.zadd(queue.failed_job_registry.key, {job_id: time.time() + DEFAULT_FAILURE_TTL})
