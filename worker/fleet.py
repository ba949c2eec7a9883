"""FleetWorker: an RQ worker that keeps many generation jobs in flight in one process.

RQ's own worker runs one job at a time in a forked work horse. A generation spends minutes
waiting on the server, so FleetWorker instead runs one asyncio task per job, up to a per-queue
number of slots, and dequeues from a queue only when it has a free slot for it and the fleet as a
whole is under its cap (worker/leases.py).

RQ's bookkeeping stays true: a claimed job is `started` and listed in its queue's
StartedJobRegistry, and results and failures are recorded as RQ's own worker records them, so
`rq info` and rq-dashboard show the fleet as it is.

Security: jobs are read with an unpickler of plain values only (common/protocol/serializer.py) whatever
the command line says, and only the project's own job function is executed, whatever a job in Redis
names; no callback named in a job is ever imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import traceback
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import redis
from pydantic import ValidationError
from rq import Queue, Worker
from rq.exceptions import DeserializationError
from rq.job import Job
from rq.logutils import setup_loghandlers

from common.connection import connection_url
from common.protocol import outcomes
from common.protocol.keys import (
    JOB_FUNCTION,
    PROBATION,
    REAPER_LOCK,
    job_id,
    worker_state_key,
)
from common.protocol.serializer import PlainPickle
from common.records import GenerationJob, GenerationResult, ServerSeen, WorkerReport
from common.settings import Settings, get_settings
from common.store import OutputStore, StoreError, open_store
from worker.generation import Generator
from worker.leases import Lease, Leases
from worker.probation import Probation
from worker.redis_calls import call_redis
from worker.sglang import ServerDown, SGLangClient, Unauthorized

log = logging.getLogger(__name__)

# How long an idle worker waits before looking at empty queues again.
POLL_INTERVAL = 0.2


class FleetWorker(Worker):
    def __init__(self, queues: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["serializer"] = PlainPickle
        super().__init__(queues, *args, **kwargs)
        # `rq worker` builds its queues with the command line's serializer: rebuild them with the fleet's, probation
        # first, whatever the command line names.
        names = [PROBATION] + [queue.name for queue in self.queues if queue.name != PROBATION]
        self.queues = [Queue(name, connection=self.connection, serializer=PlainPickle) for name in names]
        self._ordered_queues = self.queues[:]
        self.settings: Settings = get_settings()
        self.worker_ttl = self.settings.lease_ttl
        self.leases = Leases(self.connection, self.settings.lease_ttl)
        self.probation = Probation(self.connection, self.settings)
        self.in_flight: dict[str, Lease] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.running = {queue.name: 0 for queue in self.queues}
        self.fatal: str | None = None

    def work(self, burst: bool = False, logging_level: str | None = None, *args: Any, **kwargs: Any) -> bool:
        """Run until stopped (or, with `burst`, until the queues are empty); False after a fatal error."""
        date_format = kwargs.get("date_format") or "%H:%M:%S"
        log_format = kwargs.get("log_format") or "%(asctime)s %(message)s"
        for name in ("rq.worker", "worker"):
            setup_loghandlers(logging_level or "INFO", date_format, log_format, name=name)
        self._check_redis()
        try:
            store = open_store(self.settings)
            problem = store.problem()
            if not problem and (removed := store.remove_leftovers()):
                log.info("removed %d temporary files that killed writers left in %s", removed, store.location)
        except StoreError as error:
            problem = str(error)
        if problem:
            raise SystemExit(f"error: FLEET_OUTPUT_DIR: {problem}")
        asyncio.run(self._work(burst, store))
        if self.fatal:
            log.error("stopped: %s", self.fatal)
        return self.fatal is None

    def _check_redis(self) -> None:
        """Refuse a Redis other than FLEET_REDIS_URL: the worker would wait for jobs the producer never sends it."""
        actual = connection_url(self.connection)
        expected = connection_url(redis.Redis.from_url(self.settings.redis_url))
        if actual != expected:
            raise SystemExit(
                f"error: this worker's Redis is {actual} (rq worker's --url or RQ_REDIS_URL), but FLEET_REDIS_URL"
                f" is {expected}, where the producer enqueues: give both the same URL"
            )

    def slots(self, queue: Queue) -> int:
        """How many more jobs of `queue` this worker may start now."""
        return self.settings.worker_concurrency(queue.name) - self.running[queue.name]

    # The main loop.

    async def _work(self, burst: bool, store: OutputStore) -> None:
        self._stop = asyncio.Event()
        self._cold_stop = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._loop.add_signal_handler(signum, self._request_stop)

        self.client = SGLangClient(self.settings)
        self.generator = Generator(self.settings, store, self.client, max_server_failures=1)
        await self.client.start()
        await call_redis(self._register)
        log.info(
            "FleetWorker %s on Redis %s: %s; servers %s",
            self.name,
            connection_url(self.connection),
            self._slot_summary(),
            ", ".join(self.settings.sglang_url),
        )
        background = [
            asyncio.create_task(self._every_heartbeat(self._heartbeat_once)),
            asyncio.create_task(self._every_heartbeat(self._reap)),
        ]
        try:
            await self._dequeue(burst)
        finally:
            await self._drain()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await call_redis(self.register_death)
            # Gone at once from `status`, rather than when the report would have expired.
            await call_redis(self.connection.delete, worker_state_key(self.name))
            await self.client.close()
        log.info("FleetWorker %s: stopped", self.name)

    async def _dequeue(self, burst: bool) -> None:
        while not self._stop.is_set():
            if not self.client.any_healthy.is_set():
                # Said once every server has answered its first probe (or failed to): not before.
                await _first(self.client.all_probed(), self._stop.wait())
                if not self.client.any_healthy.is_set() and not self._stop.is_set():
                    problems = "; ".join(f"{server.url}: {server.problem}" for server in self.client.servers)
                    log.warning("no healthy server (%s): not dequeuing until one answers /health_generate", problems)
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
                lease = Lease(queue, self.name)
                fields = await call_redis(self.leases.claim, lease, self.settings.concurrency(queue.name))
                if fields is None:
                    break
                if lease.job_id in self.in_flight:
                    # Our own job, requeued while Redis stalled past its lease: this worker still runs it.
                    await call_redis(self.leases.finish, self.connection, lease)
                    continue
                self.in_flight[lease.job_id] = lease
                self.running[queue.name] += 1
                self.tasks[lease.job_id] = asyncio.create_task(self._perform(lease, fields))
                claimed += 1
        return claimed

    # One job.

    async def _perform(self, lease: Lease, fields: dict[bytes, bytes]) -> None:
        try:
            job = Job(lease.job_id, connection=self.connection, serializer=PlainPickle)
            try:
                job.restore(fields)
            except Exception as error:
                log.warning("job %s is unreadable: %s", lease.job_id, error)
                await call_redis(self._record_unreadable, lease, f"Refused: unreadable job hash ({error})")
                return
            try:
                arguments = self._arguments(job)
                while not lease.locked:
                    # Another execution is generating this sample (a copy of its job survived a Redis
                    # restart, say): wait for it, then find the output committed and skip.
                    await asyncio.sleep(self.settings.heartbeat_interval)
                    await call_redis(self.leases.take_lock, lease)
                result = await self.generator.run(job.id, arguments)
            except asyncio.CancelledError:
                if not lease.lost:
                    raise  # the drain puts the job back in its queue
                await call_redis(self.leases.finish, self.connection, lease)
            except ServerDown as error:
                await call_redis(self._server_went_down, job, lease, error)
            except Unauthorized as error:
                self.fatal = f"{error}; check FLEET_SGLANG_API_KEY"
                self._stop.set()
                await call_redis(self.leases.finish, self.connection, lease, requeue=True)
            except Exception as error:
                log.warning("job %s failed: %s: %s", lease.job_id, type(error).__name__, error)
                failure = str(error) if isinstance(error, _Refused) else "".join(traceback.format_exception(error))
                await call_redis(self._record_failure, job, lease, failure)
            else:
                await call_redis(self._record_success, job, lease, arguments.partition, result)
                log.info("%s: %s done %s", lease.queue.name, job.id, result)
        finally:
            self._done(lease)

    def _arguments(self, job: Job) -> GenerationJob:
        """The job's arguments, if it is one this worker may run."""
        try:
            function = job.func_name
        except DeserializationError as error:
            raise _Refused(f"Refused: job data is not plain data written by the producer ({error})") from error
        if function != JOB_FUNCTION:
            raise _Refused(f"Refused: FleetWorker runs only {JOB_FUNCTION}, not {function!r}")
        try:
            arguments = GenerationJob.model_validate(job.kwargs)
        except ValidationError as error:
            raise _Refused(f"Refused: bad job arguments: {error}") from error
        if job.id != job_id(arguments.partition, arguments.sample_id, arguments.version):
            raise _Refused(
                f"Refused: job ID {job.id} is not the producer's for {arguments.partition}/{arguments.sample_id}"
            )
        return arguments

    def _done(self, lease: Lease) -> None:
        if self.in_flight.get(lease.job_id) is lease:
            del self.in_flight[lease.job_id]
            self.tasks.pop(lease.job_id, None)
            self.running[lease.queue.name] -= 1
        self._slot_freed.set()

    def _server_went_down(self, job: Job, lease: Lease, error: ServerDown) -> None:
        """The job's request was in flight when its server went down: probation finds out whether it did that."""
        if lease.queue.name != PROBATION:
            self.probation.suspect(lease)
            log.info("%s: its server went down while it ran (%s): to probation", job.id, error)
            return
        crashes = self.probation.crashed(lease)
        if crashes >= self.settings.max_crashes_alone:
            failure = f"CrashesTheServer: the server went down {crashes} times while this prompt ran alone on it"
            log.warning("job %s failed: %s", job.id, failure)
            self._record_failure(job, lease, f"{failure}; last: {error}")
            return
        self.leases.finish(self.connection, lease, requeue=True)
        log.info("%s: its server went down again while it ran in probation (%s)", job.id, error)

    def _record_success(self, job: Job, lease: Lease, partition: str, result: GenerationResult) -> None:
        ended_at = datetime.now(UTC)
        execution = {"execution_id": lease.execution_id, "started_at": lease.started_at, "ended_at": ended_at}
        with self.connection.pipeline() as pipeline:
            outcomes.record_success(pipeline, job, result, self.settings.result_ttl, self.name, **execution)
            self.leases.finish(pipeline, lease)
            if lease.queue.name == PROBATION:
                self.probation.passed(pipeline)
            outcomes.record_counts(pipeline, partition, result)
            self.increment_successful_job_count(pipeline=pipeline)
            self.increment_total_working_time(ended_at - lease.started_at, pipeline)
            pipeline.execute()

    def _record_failure(self, job: Job, lease: Lease, failure: str) -> None:
        ended_at = datetime.now(UTC)
        execution = {"execution_id": lease.execution_id, "started_at": lease.started_at, "ended_at": ended_at}
        with self.connection.pipeline() as pipeline:
            outcomes.record_failure(pipeline, job, failure, self.name, **execution)
            self.leases.finish(pipeline, lease)
            self.increment_failed_job_count(pipeline)
            pipeline.execute()

    def _record_unreadable(self, lease: Lease, failure: str) -> None:
        with self.connection.pipeline() as pipeline:
            outcomes.record_unreadable(pipeline, lease.queue, lease.job_id, failure)
            self.leases.finish(pipeline, lease)
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
        tasks = list(self.tasks.values())
        if tasks and not self.fatal:
            everything = asyncio.gather(*tasks, return_exceptions=True)
            grace = asyncio.sleep(self.settings.shutdown_grace)
            await _first(asyncio.shield(everything), self._cold_stop.wait(), grace)
        left = list(self.in_flight.values())
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for lease in left:
            await call_redis(self.leases.finish, self.connection, lease, requeue=True)
        if left:
            log.info("requeued %d unfinished jobs", len(left))

    # Background duties, each once per heartbeat interval.

    async def _every_heartbeat(self, duty: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            try:
                await call_redis(duty)
            except Exception:
                # A duty that fails once (a Redis error other than a lost connection) must not stop for good.
                log.exception("%s failed; trying again in %.1fs", duty.__name__, self.settings.heartbeat_interval)

    def _register(self) -> None:
        """Register with RQ, once: a registration whose reply was lost (Redis stalled) is already done."""
        with contextlib.suppress(ValueError):  # RQ's "There exists an active worker named ..."
            self.register_birth()

    def _heartbeat_once(self) -> None:
        if not self.connection.hexists(self.key, "birth"):
            # Redis lost our registration (restarted, flushed, or the key lapsed while Redis stalled).
            self.connection.delete(self.key)
            self._register()
        leases = list(self.in_flight.values())
        with self.connection.pipeline(transaction=False) as pipeline:
            self.heartbeat(self.settings.lease_ttl + int(self.settings.heartbeat_interval), pipeline=pipeline)
            self.set_state("busy" if leases else "idle", pipeline=pipeline)
            pipeline.set(worker_state_key(self.name), self.report().to_json(), ex=self.settings.lease_ttl)
            for lease in leases:
                self.leases.renew(pipeline, lease)
            replies = pipeline.execute()
        for lease, holds_lock in zip(leases, replies[len(replies) - len(leases) :], strict=True):
            if lease.locked and not holds_lock and not lease.lost:
                log.warning("another execution took the generation lock of %s: leaving the sample to it", lease.job_id)
                lease.lost = True
                # The heartbeat runs in a thread: the task is cancelled on the loop's.
                if task := self.tasks.get(lease.job_id):
                    self._loop.call_soon_threadsafe(task.cancel)

    def _reap(self) -> None:
        """Requeue the jobs of workers that died (their leases lapsed)."""
        if not self.connection.set(REAPER_LOCK, self.name, nx=True, px=int(self.settings.heartbeat_interval * 1000)):
            return
        for queue in self.queues:
            requeued = self.leases.reap(queue)
            if requeued:
                log.warning("requeued %d jobs of %s whose worker stopped renewing their leases", requeued, queue.name)

    def report(self) -> WorkerReport:
        """What status tooling shows of this worker: jobs in flight per queue and what it sees of the servers."""
        # Probation is every FleetWorker's, and shown only while this worker runs some of its jobs.
        shown = [queue.name for queue in self.queues if queue.name != PROBATION or self.running[PROBATION]]
        return WorkerReport(
            name=self.name,
            host=self.hostname,
            pid=self.pid,
            queues=shown,
            in_flight={name: self.running[name] for name in shown},
            slots={name: self.settings.worker_concurrency(name) for name in shown},
            servers=[
                ServerSeen(
                    url=server.url, healthy=server.healthy, in_flight=server.in_flight, down_since=server.down_since
                )
                for server in self.client.servers
            ],
            heartbeat_at=time.time(),
        )

    def _slot_summary(self) -> str:
        limits = self.settings.worker_concurrency, self.settings.concurrency
        named = [queue for queue in self.queues if queue.name != PROBATION]
        return ", ".join(f"{q.name} x{limits[0](q.name)} (fleet cap {limits[1](q.name)})" for q in named)


class _Refused(Exception):
    """A job this worker will not run: its failure message says why."""


async def _first(*awaitables: Awaitable[Any]) -> None:
    """Wait until the first of `awaitables` completes, then cancel the others."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
