"""FleetWorker: an RQ worker that keeps many generation jobs in flight in one process.

RQ's own worker runs one job at a time in a forked work horse. A generation spends minutes
waiting on the server, so FleetWorker instead runs one asyncio task per job, up to a per-queue
number of slots, and dequeues from a queue only when it has a free slot for it.

RQ's bookkeeping stays true: a claimed job is `started` and listed in the queue's
StartedJobRegistry under a lease that the worker's heartbeat renews; results and failures are
recorded by RQ's own Job methods. When a worker dies its leases lapse, and any live worker's
maintenance runs RQ's StartedJobRegistry.cleanup, which puts abandoned jobs back in their queues
(jobs are created with a Retry budget for exactly this).

Security: jobs are read with RQ's JSON serializer whatever the command line says, and only the
project's own job function is executed, whatever a job in Redis names.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import ValidationError
from rq import Queue, Worker
from rq.exceptions import DeserializationError
from rq.job import Job, JobStatus
from rq.logutils import setup_loghandlers
from rq.registry import StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from common.keys import (
    COMPLETIONS_KEY,
    COMPLETIONS_MAXLEN,
    JOB_FUNCTION,
    LOCK_PREFIX,
    PREFIX,
    TOTALS_KEY,
    generation_lock_key,
    worker_state_key,
)
from common.records import GenerationJob
from common.settings import Settings, get_settings
from common.store import OutputStore
from worker.generation import Generator
from worker.redis_calls import call_redis
from worker.sglang import SGLangClient

log = logging.getLogger(__name__)

# How long an idle worker waits before looking at empty queues again.
POLL_INTERVAL = 0.2
MAINTENANCE_LOCK = f"{PREFIX}:maintenance"

# Pop the next job that is really waiting and mark it started, in one atomic step, so that no job is
# ever popped without being listed as started. The queue's StartedJobRegistry doubles as the fleet-wide
# semaphore: its entries with an unexpired lease are the jobs in flight in every worker on every host,
# so nothing is claimed once they reach the cap, and a dead worker's slots free up as its leases lapse.
# An ID whose job is missing, or no longer `queued` (pushed twice, finished or canceled meanwhile), is
# dropped. It also takes the sample's generation lock when free. Returns the job ID, 1 if the lock was
# taken, then the job hash, so that no second round trip fetches it.
# KEYS: queue list, started registry.
# ARGV: lease expiry, worker name, RQ timestamp, job key prefix, execution ID, now, fleet cap,
#       lock key prefix, lease in milliseconds.
CLAIM_SCRIPT = """
if redis.call('ZCOUNT', KEYS[2], ARGV[6], '+inf') >= tonumber(ARGV[7]) then
    return false
end
while true do
    local job_id = redis.call('LPOP', KEYS[1])
    if not job_id then
        return false
    end
    local job_key = ARGV[4] .. job_id
    if redis.call('HGET', job_key, 'status') == 'queued' then
        redis.call('HSET', job_key, 'status', 'started', 'worker_name', ARGV[2],
                   'started_at', ARGV[3], 'last_heartbeat', ARGV[3])
        redis.call('ZADD', KEYS[2], ARGV[1], job_id .. ':' .. ARGV[5])
        local locked = redis.call('SET', ARGV[8] .. job_id, ARGV[2], 'NX', 'PX', ARGV[9]) and 1 or 0
        local job = redis.call('HGETALL', job_key)
        table.insert(job, 1, locked)
        table.insert(job, 1, job_id)
        return job
    end
end
"""

# Put a job this worker started back at the front of its queue, unless it has moved on meanwhile.
# KEYS: started registry, queue list, job hash. ARGV: registry entry, job ID, now.
REQUEUE_SCRIPT = """
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[3], 'status') == 'started' then
    redis.call('HSET', KEYS[3], 'status', 'queued', 'enqueued_at', ARGV[3])
    redis.call('LPUSH', KEYS[2], ARGV[2])
    return 1
end
return 0
"""


# Renew a generation lock if it is ours or has lapsed (e.g. Redis lost it); never take one held by another.
# KEYS: the lock. ARGV: worker name, lease in milliseconds.
RENEW_LOCK_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
    return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return false
"""
RELEASE_LOCK_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass
class InFlight:
    job_id: str
    queue: Queue
    execution_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    task: asyncio.Task[None] | None = None
    locked: bool = False

    @property
    def registry_entry(self) -> str:
        return f"{self.job_id}:{self.execution_id}"

    @property
    def lock(self) -> str:
        return generation_lock_key(self.job_id)


class FleetWorker(Worker):
    def __init__(self, queues: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["serializer"] = JSONSerializer
        super().__init__(queues, *args, **kwargs)
        # `rq worker` builds its queues with the command line's serializer: rebuild them with JSON.
        self.queues = [
            Queue(queue.name, connection=self.connection, serializer=JSONSerializer) for queue in self.queues
        ]
        self._ordered_queues = self.queues[:]
        self.settings: Settings = get_settings()
        self.worker_ttl = self.settings.lease_ttl
        self.in_flight: dict[str, InFlight] = {}
        self.running = {queue.name: 0 for queue in self.queues}
        self._claim = self.connection.register_script(CLAIM_SCRIPT)
        self._requeue = self.connection.register_script(REQUEUE_SCRIPT)
        self._renew_lock = self.connection.register_script(RENEW_LOCK_SCRIPT)
        self._release_lock = self.connection.register_script(RELEASE_LOCK_SCRIPT)

    def work(self, burst: bool = False, logging_level: str | None = None, *args: Any, **kwargs: Any) -> bool:
        date_format = kwargs.get("date_format") or "%H:%M:%S"
        log_format = kwargs.get("log_format") or "%(asctime)s %(message)s"
        for name in ("rq.worker", "worker"):
            setup_loghandlers(logging_level or "INFO", date_format, log_format, name=name)
        return asyncio.run(self._work(burst))

    def slots(self, queue: Queue) -> int:
        """How many more jobs of `queue` this worker may start now."""
        return self.settings.worker_concurrency(queue.name) - self.running[queue.name]

    # The main loop.

    async def _work(self, burst: bool) -> bool:
        self._stop = asyncio.Event()
        self._cold_stop = asyncio.Event()
        self._slot_freed = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._request_stop)

        self.client = SGLangClient(self.settings)
        self.generator = Generator(self.settings, self.connection, OutputStore(self.settings.samples_dir), self.client)
        await self.client.start()
        await call_redis(self.register_birth)
        log.info("FleetWorker %s: queues %s", self.name, self._slot_summary())
        background = [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._maintenance())]
        try:
            await self._dequeue(burst)
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await call_redis(self.register_death)
            await self.client.close()
        log.info("FleetWorker %s: stopped", self.name)
        return True

    async def _dequeue(self, burst: bool) -> None:
        while not self._stop.is_set():
            if not self.client.any_healthy.is_set():
                log.info("no healthy server: not dequeuing until one answers /health_generate")
                await _first(self.client.any_healthy.wait(), self._stop.wait())
                continue
            claimed = await self._claim_free_slots()
            if burst and not claimed and not self.in_flight:
                return
            if not claimed:
                self._slot_freed.clear()
                await _first(self._slot_freed.wait(), self._stop.wait(), asyncio.sleep(POLL_INTERVAL))

    async def _claim_free_slots(self) -> int:
        claimed = 0
        for queue in self.queues:
            while self.slots(queue) > 0 and not self._stop.is_set():
                entry = InFlight("", queue)
                job = await call_redis(self._claim_one, entry)
                if job is None:
                    break
                entry.job_id = job.id
                self.in_flight[job.id] = entry
                self.running[queue.name] += 1
                entry.task = asyncio.create_task(self._perform(job, entry))
                claimed += 1
        return claimed

    def _claim_one(self, entry: InFlight) -> Job | None:
        now = time.time()
        stamp = _rq_time(entry.started_at)
        cap = self.settings.concurrency(entry.queue.name)
        args = [now + self.settings.lease_ttl, self.name, stamp, Job.redis_job_namespace_prefix, entry.execution_id]
        args += [now, cap, LOCK_PREFIX, self.settings.lease_ttl * 1000]
        reply = self._claim(keys=[entry.queue.key, entry.queue.started_job_registry.key], args=args)
        if not reply:
            return None
        job_id, locked, *fields = reply
        entry.locked = bool(locked)
        job = Job(job_id.decode(), connection=self.connection, serializer=JSONSerializer)
        job.restore(dict(zip(fields[::2], fields[1::2], strict=True)))
        return job

    # One job.

    async def _perform(self, job: Job, entry: InFlight) -> None:
        try:
            arguments = self._arguments(job)
            while not entry.locked:
                # Another worker is generating this sample (a copy of its job survived a Redis restart, say):
                # wait for it, then find the output committed and skip.
                await asyncio.sleep(self.settings.heartbeat_interval)
                entry.locked = await call_redis(self._take_lock, entry)
            result = await self.generator.run(job.id, arguments)
        except asyncio.CancelledError:
            raise  # the drain puts the job back in its queue
        except _Refused as error:
            await call_redis(self._record_failure, job, entry, str(error))
        except Exception as error:
            log.warning("job %s failed: %s: %s", job.id, type(error).__name__, error)
            failure = "".join(traceback.format_exception(error))
            await call_redis(self._record_failure, job, entry, failure)
        else:
            await call_redis(self._record_success, job, entry, result)
            log.info("%s: %s done %s", entry.queue.name, job.id, result)
        self._done(entry)

    def _arguments(self, job: Job) -> GenerationJob:
        """The job's arguments, if it is one this worker may run."""
        try:
            function = job.func_name
        except DeserializationError as error:
            raise _Refused(f"Refused: job data is not JSON written by the producer ({error})") from error
        if function != JOB_FUNCTION:
            raise _Refused(f"Refused: FleetWorker runs only {JOB_FUNCTION}, not {function!r}")
        try:
            return GenerationJob.model_validate(job.kwargs)
        except ValidationError as error:
            raise _Refused(f"Refused: bad job arguments: {error}") from error

    def _take_lock(self, entry: InFlight) -> bool:
        return bool(self.connection.set(entry.lock, self.name, nx=True, px=self.settings.lease_ttl * 1000))

    def _done(self, entry: InFlight) -> None:
        if self.in_flight.pop(entry.job_id, None) is not None:
            self.running[entry.queue.name] -= 1
        self._slot_freed.set()

    def _record_success(self, job: Job, entry: InFlight, result: dict[str, Any]) -> None:
        ended_at = datetime.now(UTC)
        ttl = self.settings.result_ttl
        with self.connection.pipeline() as pipeline:
            # What RQ's Job._handle_success does, less re-saving the whole job: its input_ids are unchanged.
            job.set_status(JobStatus.FINISHED, pipeline=pipeline)
            pipeline.hset(job.key, "ended_at", _rq_time(ended_at))
            Result.create(
                job,
                Result.Type.SUCCESSFUL,
                ttl,
                return_value=result,
                worker_name=self.name,
                pipeline=pipeline,
                execution_id=entry.execution_id,
                execution_started_at=entry.started_at,
                execution_ended_at=ended_at,
            )
            job.finished_job_registry.add(job, ttl, pipeline)
            job.cleanup(ttl, pipeline=pipeline, remove_from_queue=False)
            pipeline.zrem(entry.queue.started_job_registry.key, entry.registry_entry)
            self._release_lock(keys=[entry.lock], args=[self.name], client=pipeline)
            if result.get("committed"):
                # Throughput figures for `python -m producer status`.
                tokens = result["completion_tokens"]
                pipeline.xadd(COMPLETIONS_KEY, {"tokens": tokens}, maxlen=COMPLETIONS_MAXLEN, approximate=True)
                pipeline.hincrby(TOTALS_KEY, "samples", 1)
                pipeline.hincrby(TOTALS_KEY, "tokens", tokens)
                pipeline.hsetnx(TOTALS_KEY, "first_at", time.time())
            self.increment_successful_job_count(pipeline=pipeline)
            self.increment_total_working_time(ended_at - entry.started_at, pipeline)
            pipeline.execute()

    def _record_failure(self, job: Job, entry: InFlight, failure: str) -> None:
        job.started_at = entry.started_at
        job.ended_at = datetime.now(UTC)
        with self.connection.pipeline() as pipeline:
            job.set_status(JobStatus.FAILED, pipeline=pipeline)
            job._handle_failure(
                failure,
                pipeline=pipeline,
                worker_name=self.name,
                execution_id=entry.execution_id,
                execution_started_at=entry.started_at,
                execution_ended_at=job.ended_at,
            )
            pipeline.zrem(entry.queue.started_job_registry.key, entry.registry_entry)
            self._release_lock(keys=[entry.lock], args=[self.name], client=pipeline)
            self.increment_failed_job_count(pipeline)
            pipeline.execute()

    def _requeue_entry(self, entry: InFlight) -> None:
        keys = [entry.queue.started_job_registry.key, entry.queue.key, Job.key_for(entry.job_id)]
        with self.connection.pipeline() as pipeline:
            self._requeue(
                keys=keys, args=[entry.registry_entry, entry.job_id, _rq_time(datetime.now(UTC))], client=pipeline
            )
            self._release_lock(keys=[entry.lock], args=[self.name], client=pipeline)
            pipeline.execute()

    # Stopping.

    def _request_stop(self) -> None:
        if self._stop.is_set():
            log.warning("second stop request: requeueing %d jobs in flight now", len(self.in_flight))
            self._cold_stop.set()
            return
        log.info(
            "stopping: no new jobs; %d in flight get up to %.0fs to finish",
            len(self.in_flight),
            self.settings.shutdown_grace,
        )
        self._stop.set()

    async def _drain(self) -> None:
        """Let in-flight jobs finish within the grace period, then put the rest back in their queues."""
        tasks = [entry.task for entry in self.in_flight.values() if entry.task]
        if tasks:
            everything = asyncio.gather(*tasks, return_exceptions=True)
            await _first(
                asyncio.shield(everything), self._cold_stop.wait(), asyncio.sleep(self.settings.shutdown_grace)
            )
        left = list(self.in_flight.values())
        for entry in left:
            if entry.task:
                entry.task.cancel()
        await asyncio.gather(*(entry.task for entry in left if entry.task), return_exceptions=True)
        for entry in left:
            await call_redis(self._requeue_entry, entry)
        if left:
            log.info("requeued %d unfinished jobs", len(left))

    # Background duties.

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            await call_redis(self._heartbeat_once)

    def _heartbeat_once(self) -> None:
        if not self.connection.exists(self.key):
            # Redis lost our registration (restarted or flushed): register again.
            self.register_birth()
        expiry = time.time() + self.settings.lease_ttl
        lease_ms = self.settings.lease_ttl * 1000
        with self.connection.pipeline(transaction=False) as pipeline:
            self.heartbeat(self.settings.lease_ttl + int(self.settings.heartbeat_interval), pipeline=pipeline)
            self.set_state("busy" if self.in_flight else "idle", pipeline=pipeline)
            for entry in list(self.in_flight.values()):
                pipeline.zadd(entry.queue.started_job_registry.key, {entry.registry_entry: expiry})
                if entry.locked:
                    self._renew_lock(keys=[entry.lock], args=[self.name, lease_ms], client=pipeline)
            pipeline.set(worker_state_key(self.name), orjson.dumps(self.report()), ex=self.settings.lease_ttl)
            pipeline.execute()

    def report(self) -> dict[str, Any]:
        """What status tooling shows of this worker: jobs in flight per queue and what it sees of the servers."""
        return {
            "name": self.name,
            "host": self.hostname,
            "pid": self.pid,
            "queues": [queue.name for queue in self.queues],
            "in_flight": dict(self.running),
            "slots": {queue.name: self.settings.worker_concurrency(queue.name) for queue in self.queues},
            "servers": [
                {
                    "url": server.url,
                    "healthy": server.healthy,
                    "in_flight": server.in_flight,
                    "down_since": server.down_since,
                }
                for server in self.client.servers
            ],
            "heartbeat_at": time.time(),
        }

    async def _maintenance(self) -> None:
        """Requeue jobs whose worker died, through RQ's own StartedJobRegistry.cleanup."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            await call_redis(self._clean_started_registries)

    def _clean_started_registries(self) -> None:
        # One worker at a time: RQ's cleanup is not atomic, and two at once would push a job twice.
        lease_ms = int(self.settings.heartbeat_interval * 1000)
        if not self.connection.set(MAINTENANCE_LOCK, self.name, nx=True, px=lease_ms):
            return
        for queue in self.queues:
            StartedJobRegistry(queue.name, connection=self.connection, serializer=JSONSerializer).cleanup()

    def _slot_summary(self) -> str:
        limits = self.settings.worker_concurrency, self.settings.concurrency
        return ", ".join(f"{q.name} x{limits[0](q.name)} (fleet cap {limits[1](q.name)})" for q in self.queues)


class _Refused(Exception):
    """A job this worker will not run: its failure message says why."""


async def _first(*awaitables: Any) -> None:
    """Wait until the first of `awaitables` completes, then cancel the others."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


def _rq_time(moment: datetime) -> str:
    """A timestamp as RQ writes them into job hashes."""
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
