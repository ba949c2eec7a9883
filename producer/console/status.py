"""The state of a run in one snapshot: progress per partition, throughput, workers, servers, failures, problems.

Every figure comes from where it is true: done from the counts workers keep as they commit (counted in the
output store when Redis has none, or with `status --recount`), totals from what the producer
recorded at enqueue, jobs from RQ's own lists and registries, worker and server health from the
workers' reports and from asking the servers. Anything that needs a look is also listed under
`problems`, so that a quiet screen means a healthy run, never a blind one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from redis import Redis

from common.protocol.keys import (
    COMPLETIONS_KEY,
    PROBATION,
    PROBATION_KEY,
    PROBATION_QUEUE_KEY,
    TOTALS_KEY,
    partition_key,
)
from common.records import Totals
from common.settings import Settings
from common.store import OutputStore
from producer.console.causes import Failure, fix_for, group_by_cause, read_failures
from producer.console.census import UNKNOWN, PartitionResolver, recorded_partitions, take_census
from producer.console.health import ServerView, inspect_servers, server_urls
from producer.console.roster import WorkerView, fleet_load, list_workers
from producer.wording import plural

# Seconds of recent completions that recent throughput and the ETAs are measured over.
WINDOW = 60.0


@dataclass
class PartitionProgress:
    name: str
    queue: str | None = None
    # From the producer's last enqueue; unknown when Redis has no record of one.
    total: int | None = None
    rejected: int | None = None
    done: int = 0
    queued: int = 0
    in_flight: int = 0
    failed: int = 0
    samples_per_s: float = 0.0

    @property
    def accepted(self) -> int | None:
        return None if self.total is None else self.total - (self.rejected or 0)

    @property
    def unqueued(self) -> int | None:
        """Accepted prompts with neither an output nor a job: lost with Redis, or canceled."""
        if self.accepted is None:
            return None
        return max(0, self.accepted - self.done - self.queued - self.in_flight - self.failed)

    @property
    def percent(self) -> float | None:
        return 100.0 * min(self.done, self.accepted) / self.accepted if self.accepted else None

    @property
    def eta_s(self) -> float | None:
        return _eta(self.queued + self.in_flight, self.samples_per_s)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {
            "accepted": self.accepted,
            "unqueued": self.unqueued,
            "percent": self.percent,
            "eta_s": self.eta_s,
        }


@dataclass
class Throughput:
    window_s: float
    samples_per_s: float
    tokens_per_s: float
    # Since the first commit of the run (TOTALS_KEY), when there is one.
    started_at: float | None = None
    samples: int = 0
    tokens: int = 0
    average_samples_per_s: float | None = None
    average_tokens_per_s: float | None = None


@dataclass
class Status:
    at: float
    redis: str
    partitions: list[PartitionProgress]
    throughput: Throughput
    workers: list[WorkerView]
    servers: list[ServerView]
    failures: list[tuple[str, list[Failure]]]
    lapsed_leases: int
    # Per queue: jobs in flight in the live workers, and the fleet-wide cap on them (FLEET_*_CONCURRENCY).
    queues: dict[str, dict[str, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # What is worth knowing but needs no action.
    notes: list[str] = field(default_factory=list)

    @property
    def eta_s(self) -> float | None:
        remaining = sum(partition.queued + partition.in_flight for partition in self.partitions)
        return _eta(remaining, self.throughput.samples_per_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "redis": self.redis,
            "partitions": {partition.name: partition.to_json() for partition in self.partitions},
            "throughput": asdict(self.throughput),
            "eta_s": self.eta_s,
            "workers": [asdict(worker) for worker in self.workers],
            "lapsed_leases": self.lapsed_leases,
            "queues": self.queues,
            "servers": [asdict(server) for server in self.servers],
            "failures": [
                {
                    "cause": cause,
                    "count": len(group),
                    "partitions": dict(sorted(_count_by_partition(group).items())),
                    "example": {"job_id": group[0].job_id, "failure": group[0].line},
                    "workers": sorted({failure.worker for failure in group if failure.worker}),
                    "fix": fix_for(cause),
                }
                for cause, group in self.failures
            ],
            "problems": self.problems,
            "notes": self.notes,
        }


def collect_status(connection: Redis, settings: Settings, store: OutputStore, recount: bool = False) -> Status:
    """The snapshot; `recount` counts each partition's committed samples in the store again."""
    seconds, microseconds = connection.time()
    # Redis's clock, not ours: stream IDs and registry scores are written against it.
    now = seconds + microseconds / 1e6
    partitions = _partitions(connection, store, recount)
    throughput = _throughput(connection, now)
    window = throughput.window_s

    resolver = PartitionResolver(connection, partitions)
    census = take_census(connection, resolver, now, window, settings.result_ttl)
    failed_by_job: dict[str, str] = {}
    for name in sorted(set(partitions) | set(census.queued) | set(census.in_flight) | set(census.failed)):
        progress = partitions.setdefault(name, PartitionProgress(name))
        # A job whose sample another execution committed is done, not in flight or failed. Queued ones are
        # not looked up (there can be millions): a worker skips them at once.
        done = {job for job in census.in_flight[name] | census.failed[name] if name != UNKNOWN and store.has(name, job)}
        progress.in_flight = len(census.in_flight[name] - done)
        failed = census.failed[name] - done
        progress.failed = len(failed)
        progress.queued = len(census.queued[name])
        progress.samples_per_s = census.finished_recently[name] / window
        failed_by_job.update(dict.fromkeys(failed, name))

    workers = list_workers(connection, settings, now)
    worker_servers = [server for worker in workers for server in worker.servers]
    servers = inspect_servers(connection, server_urls(connection, settings, worker_servers), now)
    _add_worker_views(servers, workers)
    status = Status(
        at=now,
        redis=settings.redis_url_redacted,
        partitions=sorted(partitions.values(), key=lambda progress: (progress.name == UNKNOWN, progress.name)),
        throughput=throughput,
        workers=workers,
        servers=servers,
        failures=group_by_cause(read_failures(connection, failed_by_job)),
        lapsed_leases=census.lapsed_leases,
        queues=fleet_load(workers, settings),
    )
    status.problems = find_problems(status)
    _note_probation(connection, status)
    if not settings.data_dir.is_dir():
        status.notes.append(
            f"FLEET_DATA_DIR {settings.data_dir} does not exist here: status needs only Redis and the store,"
            " but enqueue, export and verify read the partitions there"
        )
    return status


def _note_probation(connection: Redis, status: Status) -> None:
    """Probation holds back every other job while it runs, so status says so, with its cap."""
    waiting, cap = connection.llen(PROBATION_QUEUE_KEY), int(connection.hget(PROBATION_KEY, "cap") or 1)
    running = status.queues.get(PROBATION, {}).get("in_flight", 0)
    if waiting or running:
        status.queues.setdefault(PROBATION, {"in_flight": running})["cap"] = cap
        status.notes.append(
            f"probation: {waiting} jobs waiting, {running} running (at most {cap} at once): a server went"
            " down with them in flight, and no other job starts until each has run in a smaller group; one running"
            " alone when a server goes down again fails as crashing it"
        )


def _partitions(connection: Redis, store: OutputStore, recount: bool) -> dict[str, PartitionProgress]:
    """Partitions the producer enqueued (with their totals) and those with outputs in the store, with their
    done counts: kept by the workers, counted in the store when Redis has none (or when asked)."""
    recorded = recorded_partitions(connection)
    partitions = {}
    for name in sorted(set(recorded) | set(store.partitions())):
        values = recorded.get(name, {})
        progress = PartitionProgress(name, queue=values.get("queue"))
        if "total" in values:
            progress.total, progress.rejected = int(values["total"]), int(values.get("rejected", 0))
        if recount or "done" not in values:
            # Reset first, then add the count: commits made meanwhile are counted by their workers.
            connection.hset(partition_key(name), "done", 0)
            progress.done = sum(1 for _ in store.sample_keys(name))
            connection.hincrby(partition_key(name), "done", progress.done)
        else:
            progress.done = int(values["done"])
        partitions[name] = progress
    return partitions


def _throughput(connection: Redis, now: float) -> Throughput:
    with connection.pipeline(transaction=False) as pipeline:
        pipeline.xrange(COMPLETIONS_KEY, min=str(int((now - WINDOW) * 1000)), max="+")
        pipeline.hgetall(TOTALS_KEY)
        recent, totals = pipeline.execute()
    totals = Totals.from_hash(totals)
    started_at = totals.first_at
    window = WINDOW if started_at is None else min(WINDOW, max(1.0, now - started_at))
    tokens = sum(int(fields.get(b"tokens", 0)) for _, fields in recent)
    throughput = Throughput(window, len(recent) / window, tokens / window, started_at)
    if started_at is not None:
        elapsed = max(1.0, now - started_at)
        throughput.samples = totals.samples
        throughput.tokens = totals.tokens
        throughput.average_samples_per_s = throughput.samples / elapsed
        throughput.average_tokens_per_s = throughput.tokens / elapsed
    return throughput


def _add_worker_views(servers: list[ServerView], workers: list[WorkerView]) -> None:
    """What the workers see of each server: their requests in flight there, and whether they find it down."""
    by_url = {server.url: server for server in servers}
    for worker in workers:
        for seen in worker.servers:
            server = by_url[seen["url"]]
            server.workers_in_flight += seen.get("in_flight", 0)
            if not seen.get("healthy", True):
                server.down_for_workers.append(worker.name)


def find_problems(status: Status) -> list[str]:
    problems = []
    for server in status.servers:
        if server.health != "healthy":
            state = f" (supervisor: {server.supervisor['state']})" if "state" in server.supervisor else ""
            problems.append(f"server {server.url} is {server.health.upper()}: {server.detail}{state}")
        elif server.down_for_workers:
            problems.append(
                f"server {server.url} answers, but workers {', '.join(server.down_for_workers)} find it down"
            )
    live = [worker for worker in status.workers if worker.state in ("ok", "starting")]
    for queue, load in status.queues.items():
        if load["in_flight"] > load["cap"]:
            problems.append(
                f"{load['in_flight']} {queue} jobs in flight across the workers, above the fleet cap of {load['cap']}:"
                " workers started with different FLEET_*_CONCURRENCY?"
            )
    for worker in status.workers:
        problems += [f"worker {worker.name} ({worker.host}, pid {worker.pid}): {flag}" for flag in worker.flags]
    waiting = sum(partition.queued + partition.in_flight for partition in status.partitions)
    if waiting and not live:
        problems.append(f"{waiting} jobs wait and no FleetWorker is alive: start workers (`python -m worker`)")
    if status.lapsed_leases:
        problems.append(
            f"{status.lapsed_leases} in-flight jobs have lapsed leases: their worker died;"
            " a live worker puts them back in their queue"
        )
    failed = sum(len(group) for _, group in status.failures)
    if failed:
        problems.append(
            f"{plural(failed, 'failed job')}, {plural(len(status.failures), 'cause')} (below): fix the cause, then"
            " `python -m producer retry-failed`"
        )
    for partition in status.partitions:
        if partition.name == UNKNOWN:
            problems.append(
                f"{partition.queued + partition.in_flight + partition.failed} jobs belong to no known partition"
            )
        elif partition.total is None:
            problems.append(f"{partition.name}: Redis has no record of its enqueue, so its total is unknown")
        elif partition.unqueued:
            problems.append(
                f"{partition.name}: {partition.unqueued} accepted prompts have neither an output nor a job:"
                f" `python -m producer enqueue --partition {partition.name}` (which also recounts what is done)"
            )
    return problems


def _eta(remaining: int, rate: float) -> float | None:
    if remaining == 0:
        return 0.0
    return remaining / rate if rate > 0 else None


def _count_by_partition(failures: list[Failure]) -> Counter[str]:
    return Counter(failure.partition for failure in failures)
