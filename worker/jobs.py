"""The job function the producer names, for RQ workers of every kind.

A FleetWorker never calls it: it runs each job with its own code, many at once (worker/fleet.py). A plain
`rq worker short long` calls it, one job at a time in a forked work horse, and gets the same outcome: the
sample generated with the same retries and committed once to the same store. It says once per worker that a
FleetWorker would keep 150 + 32 generations in flight where it keeps one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rq import get_current_job
from rq.job import Job

from common.protocol import outcomes
from common.protocol.keys import hint_key, job_id
from common.records import GenerationJob, GenerationResult
from common.settings import Settings, get_settings
from common.store import OutputStore, open_store
from worker.generation import Generator
from worker.sglang import SGLangClient

log = logging.getLogger("rq.worker")


def generate(**kwargs: Any) -> dict[str, Any]:
    """Generate and commit one sample in a plain RQ worker; the return value is the job's result."""
    job = get_current_job()
    assert job is not None, "a generation job runs in an RQ worker"
    try:
        arguments = GenerationJob.model_validate(kwargs)
        if job.id != job_id(arguments.partition, arguments.sample_id, arguments.version):
            raise ValueError(f"job ID {job.id} is not the producer's for {arguments.partition}/{arguments.sample_id}")
        _hint_once(job)
        settings = get_settings()
        result = asyncio.run(_generate(settings, open_store(settings), job.id, arguments))
    except Exception:
        # The retries a job is created with are for workers that die; generation failures were retried already.
        job.retries_left = 0
        raise
    with job.connection.pipeline() as pipeline:
        outcomes.record_counts(pipeline, arguments.partition, result)
        pipeline.execute()
    return result.model_dump()


async def _generate(
    settings: Settings, store: OutputStore, identifier: str, arguments: GenerationJob
) -> GenerationResult:
    client = SGLangClient(settings)
    await client.start(probe=False)
    try:
        return await Generator(settings, store, client).run(identifier, arguments)
    finally:
        await client.close()


def _hint_once(job: Job) -> None:
    if job.connection.set(hint_key(job.worker_name or ""), 1, nx=True, ex=24 * 3600):
        log.warning(
            "a plain RQ worker runs one generation at a time: `rq worker -w worker.FleetWorker short long`"
            " (or RQ_WORKER_CLASS=worker.FleetWorker, or `python -m worker`) keeps 150 short + 32 long in flight"
        )
