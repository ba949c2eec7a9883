"""`python -m producer status` on real runs: every job state counted, workers and servers told apart."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import orjson
import pytest
import redis
from rq import Worker
from rq.queue import Queue

from common.protocol.keys import PROBATION_KEY, PROBATION_QUEUE_KEY, server_metrics_key, worker_state_key
from common.records import WorkerReport
from common.store import open_store
from producer.console.roster import list_workers
from producer.console.status import collect_status
from tests.harness import Fleet, Simulator, wait_until

Start = Callable[..., Simulator]


def reported_in_flight(client: redis.Redis) -> dict[str, int] | None:
    reports = [WorkerReport.model_validate_json(raw) for raw in client.mget(client.keys(worker_state_key("*"))) if raw]
    return reports[0].in_flight if len(reports) == 1 else None


def status_json(fleet: Fleet) -> dict:
    return orjson.loads(fleet.producer("status", "--json").stdout)


def test_status_counts_done_queued_in_flight_failed_and_rejected(fleet: Fleet, start_simulator: Start, redis_client):
    small = start_simulator("--context-length", "60")
    slow = start_simulator("--token-latency", "1")
    fleet.point_at(small, slow)
    fleet.env["FLEET_SHORT_MAX_NEW_TOKENS"] = "16"
    good = [{"id": f"p-{n}", "input_ids": [5] * 10} for n in range(6)]
    too_long = [{"id": f"big-{n}", "input_ids": [5] * 80} for n in range(2)]  # the server answers HTTP 400
    fleet.write_partition("p", [*good, *too_long, "{not json"])
    fleet.write_partition("q", [{"id": f"q-{n}", "input_ids": [5] * 10} for n in range(5)])
    (fleet.data_dir / "partitions.toml").write_text('[q]\nqueue = "long"\nmax_new_tokens = 40\n')
    fleet.producer("enqueue")
    assert fleet.start_worker("short", "--burst", env={"FLEET_SGLANG_URL": small.url}).wait(timeout=60) == 0
    # Two of q's jobs stay in flight on the slow server for the rest of the test; three wait.
    fleet.start_worker("long", env={"FLEET_SGLANG_URL": slow.url, "FLEET_LONG_CONCURRENCY": "2"})
    started = Queue("long", connection=redis_client).started_job_registry
    wait_until(lambda: started.count == 2, what="2 jobs in flight")
    wait_until(lambda: reported_in_flight(redis_client) == {"long": 2}, what="the worker to report 2 in flight")

    status = status_json(fleet)

    counts = ("total", "rejected", "done", "queued", "in_flight", "failed")
    assert {key: status["partitions"]["p"][key] for key in counts} == dict(zip(counts, (9, 1, 6, 0, 0, 2), strict=True))
    assert {key: status["partitions"]["q"][key] for key in counts} == dict(zip(counts, (5, 0, 0, 3, 2, 0), strict=True))
    assert status["partitions"]["p"]["percent"] == 75.0 and status["partitions"]["p"]["unqueued"] == 0
    assert status["throughput"]["samples"] == 6 and status["throughput"]["samples_per_s"] > 0
    # Nothing of p is left to do; q's five jobs are left, at the pace of the whole fleet (q has finished none).
    assert status["partitions"]["p"]["eta_s"] == 0.0 and status["partitions"]["q"]["eta_s"] is None
    assert status["eta_s"] == pytest.approx(5 / status["throughput"]["samples_per_s"])
    [failure] = status["failures"]
    assert failure["count"] == 2 and failure["partitions"] == {"p": 2}
    assert failure["cause"].startswith("PermanentError: HTTP 400:") and "http://" not in failure["cause"]
    [worker] = status["workers"]
    assert worker["state"] == "ok" and worker["in_flight"] == {"long": 2} and worker["queues"] == ["long"]
    assert worker["host"] and worker["pid"] and worker["heartbeat_age_s"] < 5
    assert [server["health"] for server in status["servers"]] == ["healthy", "healthy"]
    assert status["queues"]["long"] == {"in_flight": 2, "cap": 32}
    assert any("2 failed jobs" in problem for problem in status["problems"])

    screen = fleet.producer("status").stdout
    assert "PermanentError: HTTP 400" in screen
    row = next(line.split() for line in screen.splitlines() if line.startswith("q "))
    assert row[:8] == ["q", "5", "0", "0", "3", "2", "0", "0"]


def test_a_crashed_server_is_told_apart_from_a_healthy_idle_one(fleet: Fleet, start_simulator: Start, redis_client):
    idle, crashed = start_simulator(), start_simulator()
    fleet.point_at(idle, crashed)
    crashed.kill()
    # The supervisor's last figures for the crashed server: a busy server, two minutes ago.
    redis_client.hset(
        server_metrics_key(crashed.url),
        mapping={"state": "restarting", "running_req": 7, "queue_req": 2, "updated_at": time.time() - 120},
    )

    status = status_json(fleet)

    servers = {server["url"]: server for server in status["servers"]}
    assert servers[idle.url]["health"] == "healthy"
    assert servers[idle.url]["metrics"]["running_req"] == 0 and servers[idle.url]["metrics_from"] == "prometheus"
    assert servers[crashed.url]["health"] == "down" and "refused" in servers[crashed.url]["detail"].lower()
    assert servers[crashed.url]["supervisor"]["state"] == "restarting"
    assert [problem for problem in status["problems"] if "server" in problem] == [
        f"server {crashed.url} is DOWN: {servers[crashed.url]['detail']} (supervisor: restarting)"
    ]
    screen = fleet.producer("status").stdout
    assert f"{crashed.url}  DOWN" in screen and f"{idle.url}  HEALTHY" in screen

    # Fresh decode figures from the supervisor's log win over a scrape.
    redis_client.hset(
        server_metrics_key(idle.url), mapping={"running_req": 3, "gen_throughput": 812.5, "updated_at": time.time()}
    )
    settings = fleet.settings()
    servers_now = collect_status(redis_client, settings, open_store(settings)).servers
    view = next(server for server in servers_now if server.url == idle.url)
    assert view.metrics_from == "supervisor" and view.metrics["running_req"] == 3


def test_workers_are_listed_with_stale_dead_and_duplicate_ones_flagged(
    fleet: Fleet, start_simulator: Start, redis_client: redis.Redis
):
    fleet.point_at(start_simulator())
    settings = fleet.settings()
    lively = fleet.start_worker()
    # A long lease keeps its report in Redis after it stops.
    frozen = fleet.start_worker(env={"FLEET_LEASE_TTL": "60"})
    plain = Worker(["short"], connection=redis_client, name="plain-rq-worker")
    plain.register_birth()

    def states() -> dict[int | None, str]:
        return {view.pid: view.state for view in list_workers(redis_client, settings, time.time())}

    wait_until(lambda: states().get(lively.pid) == states().get(frozen.pid) == "ok", what="two reporting workers")
    duplicates = [view for view in list_workers(redis_client, settings, time.time()) if view.pid != plain.pid]
    assert all(any("duplicate: 2 FleetWorkers" in flag for flag in view.flags) for view in duplicates)
    frozen.signal(signal.SIGSTOP)
    wait_until(lambda: states()[frozen.pid] == "stale", what="the stopped worker to go stale")
    wait_until(lambda: states()[plain.pid] == "dead", what="the plain RQ worker to count as dead")
    assert states()[lively.pid] == "ok"

    status = status_json(fleet)
    states = {worker["name"]: worker["state"] for worker in status["workers"]}
    assert sorted(states.values()) == ["dead", "ok", "stale"] and states["plain-rq-worker"] == "dead"
    assert any("plain-rq-worker" in problem and "no fleet heartbeat" in problem for problem in status["problems"])
    screen = fleet.producer("status").stdout
    assert "STALE" in screen and "DEAD" in screen and "workers (1 live of 3)" in screen
    frozen.signal(signal.SIGCONT)


def test_in_flight_above_the_fleet_cap_is_a_problem(fleet: Fleet, redis_client: redis.Redis):
    fleet.env["FLEET_SHORT_CONCURRENCY"] = "150"
    for name in ("a", "b"):
        report = WorkerReport(
            name=name,
            host=f"host-{name}",
            pid=1,
            queues=["short"],
            in_flight={"short": 100},
            slots={"short": 150},
            heartbeat_at=time.time(),
        )
        redis_client.set(worker_state_key(name), report.to_json(), ex=60)

    settings = fleet.settings()
    status = collect_status(redis_client, settings, open_store(settings))

    assert status.queues["short"] == {"in_flight": 200, "cap": 150}
    assert any("200 short jobs in flight across the workers, above the fleet cap of 150" in p for p in status.problems)


def test_status_shows_jobs_on_probation_and_counts_them_as_queued(fleet: Fleet, redis_client: redis.Redis):
    fleet.write_partition("p", [{"id": f"p-{n}", "input_ids": [5] * 10} for n in range(3)])
    fleet.producer("enqueue")
    # As a worker leaves it after a server went down with this job in flight and cut probation's cap to 2.
    redis_client.lmove(Queue("short", connection=redis_client).key, PROBATION_QUEUE_KEY)
    redis_client.hset(PROBATION_KEY, "cap", 2)

    status = status_json(fleet)

    assert status["queues"]["probation"] == {"in_flight": 0, "cap": 2}
    assert any(note.startswith("probation: 1 jobs waiting, 0 running (at most 2 at once)") for note in status["notes"])
    assert status["partitions"]["p"]["queued"] == 3
    assert "probation: 1 jobs waiting" in fleet.producer("status").stdout
