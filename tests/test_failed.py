"""`retry-failed` and `cancel` against a real redis-server, workers and simulator."""

from __future__ import annotations

import pickle
import time
import zlib
from base64 import b64encode
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from rq import Retry
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import FailedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer

from common.protocol.keys import JOB_FUNCTION, REQUEUES_AFTER_WORKER_DEATH, job_id
from common.records import OutputRecord
from common.store import LocalStore
from producer.console.retry import retry_failed
from tests.harness import Fleet, Simulator, counts

Start = Callable[..., Simulator]
FAILURE = "worker.sglang.PermanentError: http://127.0.0.1:1: HTTP 400: too long"


def queued(client: redis.Redis, queue: str = "short") -> list[str]:
    return [item.decode() for item in client.lrange(f"rq:queue:{queue}", 0, -1)]


def status_of(client: redis.Redis, identifier: str) -> str:
    return client.hget(Job.key_for(identifier), "status").decode()


def failed_job(client: redis.Redis, sample_id: str, retries_left: int = REQUEUES_AFTER_WORKER_DEATH) -> str:
    """A job of partition p as a FleetWorker leaves it failed: in the failed registry, its failure in its results."""
    job = Job.create(
        JOB_FUNCTION,
        kwargs={"partition": "p", "sample_id": sample_id},
        connection=client,
        id=job_id("p", sample_id),
        origin="short",
        description=f"generate p/{sample_id}",
        serializer=JSONSerializer,
        retry=Retry(max=REQUEUES_AFTER_WORKER_DEATH),
    )
    job.retries_left = retries_left
    with client.pipeline() as pipeline:
        job.set_status(JobStatus.FAILED, pipeline=pipeline)
        job._handle_failure(FAILURE, pipeline=pipeline)
        pipeline.execute()
    return job.id


class TouchOnUnpickle:
    """Creates a file when unpickled: proof that something read from Redis was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


class Interrupted(BaseException):
    """The process stopped there (a kill, a lost connection): nothing after it runs."""


@contextmanager
def interrupted_after(round_trips: int) -> Iterator[None]:
    """Raise Interrupted right after the given number of round trips to Redis, commands or pipelines."""
    count = 0

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            reply = original(*args, **kwargs)
            count += 1
            if count == round_trips:
                raise Interrupted
            return reply

        return call

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(redis.Redis, "execute_command", counted(redis.Redis.execute_command))
        patch.setattr(redis.client.Pipeline, "execute", counted(redis.client.Pipeline.execute))
        yield


def test_failure_records_are_never_unpickled(fleet: Fleet, redis_client: redis.Redis, tmp_path: Path):
    identifier = failed_job(redis_client, "big")
    marker = tmp_path / "unpickled"
    # The latest result of the failed job, as anyone who can write to Redis could forge it.
    forged = {
        "type": Result.Type.FAILED.value,
        "return_value": b64encode(pickle.dumps(TouchOnUnpickle(marker))),
        "exc_string": b64encode(zlib.compress(FAILURE.encode())),
    }
    redis_client.xadd(Result.get_key(identifier), forged)

    status = orjson.loads(fleet.producer("status", "--json").stdout)
    assert [failure["cause"] for failure in status["failures"]] == ["PermanentError: HTTP 400: too long"]
    assert not marker.exists()
    assert "requeued 1 failed job (p: 1)" in fleet.producer("retry-failed").stdout
    assert not marker.exists()


def test_retry_failed_interrupted_anywhere_leaves_the_job_failed_or_queued(redis_client: redis.Redis, tmp_path: Path):
    """Never `failed` outside the failed registry: enqueue would skip it and retry-failed not see it."""
    store = LocalStore(tmp_path)
    registry = FailedJobRegistry("short", connection=redis_client, serializer=JSONSerializer)
    round_trips = 1
    while True:
        redis_client.flushall()
        # Three worker deaths spent three of its retries before it failed.
        identifier = failed_job(redis_client, "big", retries_left=REQUEUES_AFTER_WORKER_DEATH - 3)
        try:
            with interrupted_after(round_trips):
                retry_failed(redis_client, store)
            finished = True
        except Interrupted:
            finished = False
        state = (status_of(redis_client, identifier), identifier in registry.get_job_ids(), queued(redis_client))
        assert state in [("failed", True, []), ("queued", False, [identifier])], f"after {round_trips} round trips"
        if finished:
            break
        round_trips += 1

    assert state == ("queued", False, [identifier])
    assert redis_client.hget(Job.key_for(identifier), "retries_left") == str(REQUEUES_AFTER_WORKER_DEATH).encode()
    # The failed registry had set the job to expire; a queued job must not.
    assert redis_client.ttl(Job.key_for(identifier)) == -1


def test_retry_failed_requeues_selected_failures_once_under_their_own_ids(
    fleet: Fleet, start_simulator: Start, redis_client: redis.Redis
):
    fleet.point_at(start_simulator("--context-length", "60"))
    fleet.env["FLEET_SHORT_MAX_NEW_TOKENS"] = "16"
    too_long = {"input_ids": [5] * 80}  # the server answers HTTP 400
    fleet.write_partition(
        "p", [{"id": "ok", "input_ids": [5] * 10}, {"id": "big-1", **too_long}, {"id": "big-2", **too_long}]
    )
    fleet.write_partition("q", [{"id": "big-3", **too_long}])
    fleet.producer("enqueue")
    assert fleet.start_worker("--burst").wait(timeout=60) == 0
    failed = FailedJobRegistry("short", connection=redis_client)
    assert failed.count == 3

    assert "requeued 0 failed jobs" in fleet.producer("retry-failed", "--cause", "no such cause").stdout
    assert failed.count == 3
    # big-2 was committed meanwhile (say, by a duplicate generation that succeeded): it is not run again.
    store = LocalStore(fleet.output_dir)
    store.commit(
        OutputRecord(
            id="big-2", partition="p", job_id=fleet.job_id("p", "big-2"), input_ids=[5], output_ids=[6], text="x",
            finish_reason={"type": "stop"}, prompt_tokens=1, completion_tokens=1, sampling_params={}, server="s",
        )
    )  # fmt: skip

    output = fleet.producer("retry-failed", "--partition", "p", "--cause", "http 400").stdout

    assert "requeued 1 failed job (p: 1)" in output
    assert "deleted 1 failed job whose sample was committed meanwhile" in output
    assert "left 1 failed job" in output
    assert (
        queued(redis_client) == [fleet.job_id("p", "big-1")]
        and status_of(redis_client, fleet.job_id("p", "big-1")) == "queued"
    )
    assert failed.get_job_ids() == [fleet.job_id("q", "big-3")]
    assert not redis_client.exists(Job.key_for(fleet.job_id("p", "big-2")))
    # Running it again finds nothing more to do: the job is queued once.
    assert "requeued 0 failed jobs" in fleet.producer("retry-failed", "--partition", "p").stdout
    assert queued(redis_client) == [fleet.job_id("p", "big-1")]

    # Against a server that takes long prompts, the retried job runs and commits under its own ID.
    fleet.point_at(start_simulator())
    assert fleet.start_worker("--burst").wait(timeout=60) == 0
    assert store.load("p", fleet.job_id("p", "big-1")) is not None
    assert status_of(redis_client, fleet.job_id("p", "big-1")) == "finished"


def test_cancel_removes_only_the_partitions_queued_jobs(fleet: Fleet, redis_client: redis.Redis):
    # "p--x" shares p's job-ID prefix "p--": the job's own description tells them apart.
    fleet.write_partition("p", [{"id": f"p-{n}", "prompt": f"Question {n}?"} for n in range(5)])
    fleet.write_partition("p--x", [{"id": f"x-{n}", "prompt": f"Other {n}?"} for n in range(3)])
    fleet.producer("enqueue")
    # One job of each is in flight, as a worker's claim leaves it.
    started = Queue("short", connection=redis_client).started_job_registry.key
    for running in (fleet.job_id("p", "p-0"), fleet.job_id("p--x", "x-0")):
        redis_client.lrem("rq:queue:short", 0, running)
        redis_client.hset(Job.key_for(running), "status", "started")
        redis_client.zadd(started, {f"{running}:e1": time.time() + 60})

    assert fleet.producer_json("cancel", "--partition", "p") == {"canceled": {"p": 4}, "in_flight": {"p": 1}}

    assert queued(redis_client) == [fleet.job_id("p--x", f"x-{n}") for n in (1, 2)]
    assert [status_of(redis_client, fleet.job_id("p", f"p-{n}")) for n in range(5)] == ["started"] + ["canceled"] * 4
    assert "canceled 0 queued jobs" in fleet.producer("cancel", "--partition", "p").stdout
    # enqueue queues the canceled jobs again.
    assert counts(fleet.producer_json("enqueue", "--partition", "p")["partitions"]["p"]) == (5, 0, 1, 0, 4, 0)
