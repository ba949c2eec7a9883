"""`retry-failed` and `cancel` against a real redis-server, workers and simulator."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
from rq.job import Job
from rq.queue import Queue
from rq.registry import FailedJobRegistry

from common.keys import job_id
from common.records import OutputRecord
from common.store import OutputStore
from tests.support import Fleet, Simulator

Start = Callable[..., Simulator]


def queued(client: redis.Redis, queue: str = "short") -> list[str]:
    return [item.decode() for item in client.lrange(f"rq:queue:{queue}", 0, -1)]


def status_of(client: redis.Redis, identifier: str) -> str:
    return client.hget(Job.key_for(identifier), "status").decode()


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
    store = OutputStore(fleet.output_dir / "samples")
    store.commit(
        OutputRecord(
            id="big-2", partition="p", job_id=job_id("p", "big-2"), input_ids=[5], output_ids=[6], text="x",
            finish_reason={"type": "stop"}, prompt_tokens=1, completion_tokens=1, sampling_params={}, server="s",
        )
    )  # fmt: skip

    output = fleet.producer("retry-failed", "--partition", "p", "--cause", "http 400").stdout

    assert "requeued 1 failed jobs (p: 1)" in output
    assert "deleted 1 failed jobs whose sample was committed meanwhile" in output
    assert "left 1 failed jobs" in output
    assert queued(redis_client) == [job_id("p", "big-1")] and status_of(redis_client, job_id("p", "big-1")) == "queued"
    assert failed.get_job_ids() == [job_id("q", "big-3")]
    assert not redis_client.exists(Job.key_for(job_id("p", "big-2")))
    # Running it again finds nothing more to do: the job is queued once.
    assert "requeued 0 failed jobs" in fleet.producer("retry-failed", "--partition", "p").stdout
    assert queued(redis_client) == [job_id("p", "big-1")]

    # Against a server that takes long prompts, the retried job runs and commits under its own ID.
    fleet.point_at(start_simulator())
    assert fleet.start_worker("--burst").wait(timeout=60) == 0
    assert store.load("p", job_id("p", "big-1")) is not None
    assert status_of(redis_client, job_id("p", "big-1")) == "finished"


def test_cancel_removes_only_the_partitions_queued_jobs(fleet: Fleet, redis_client: redis.Redis):
    # "p--x" shares p's job-ID prefix "p--": the job's own description tells them apart.
    fleet.write_partition("p", [{"id": f"p-{n}", "prompt": f"Question {n}?"} for n in range(5)])
    fleet.write_partition("p--x", [{"id": f"x-{n}", "prompt": f"Other {n}?"} for n in range(3)])
    fleet.producer("enqueue")
    # One of p's jobs is in flight, as a worker's claim leaves it.
    running = job_id("p", "p-0")
    redis_client.lrem("rq:queue:short", 0, running)
    redis_client.hset(Job.key_for(running), "status", "started")
    redis_client.zadd(
        Queue("short", connection=redis_client).started_job_registry.key, {f"{running}:e1": time.time() + 60}
    )

    output = fleet.producer("cancel", "--partition", "p").stdout

    assert "p: canceled 4 queued jobs; 1 in flight will finish" in output
    assert queued(redis_client) == [job_id("p--x", f"x-{n}") for n in range(3)]
    assert [status_of(redis_client, job_id("p", f"p-{n}")) for n in range(5)] == ["started"] + ["canceled"] * 4
    assert "canceled 0 queued jobs" in fleet.producer("cancel", "--partition", "p").stdout
    # enqueue queues the canceled jobs again.
    assert fleet.producer("enqueue", "--partition", "p").stdout.splitlines()[1].split() == [
        "p",
        "5",
        "0",
        "1",
        "0",
        "4",
        "0",
    ]
