"""FleetWorker's concurrency: fleet-wide caps across processes, failover between servers."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.harness import ROOT, Fleet, Start, assert_exactly_once, prompts, wait_for_outputs, wait_until

SLOW = ("--token-latency", "0.01", "--min-output-tokens", "40", "--max-output-tokens", "40")


def test_two_workers_never_exceed_the_fleet_cap(fleet: Fleet, start_simulator: Start):
    simulator = start_simulator(*SLOW, "--max-running", "1000")
    fleet.point_at(simulator)
    fleet.env |= {"FLEET_SHORT_CONCURRENCY": "12", "FLEET_LONG_CONCURRENCY": "3"}
    fleet.write_partition("p", prompts(90))
    fleet.write_partition("q", prompts(30, "q"))
    (fleet.data_dir / "partitions.toml").write_text('[q]\nqueue = "long"\n')
    fleet.producer("enqueue")
    workers = [fleet.start_worker("short", "long", "--burst") for _ in range(2)]
    assert all(worker.wait(timeout=120) == 0 for worker in workers)

    stats = simulator.stats()
    # Both processes could each hold 15; together they hold the fleet's 12 + 3, and use all of it.
    assert stats["peak_in_flight"] == 15
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(90)])
    assert_exactly_once(fleet, "q", [f"q-{n}" for n in range(30)])


def test_per_process_limit_within_the_fleet_cap(fleet: Fleet, start_simulator: Start):
    simulator = start_simulator(*SLOW)
    fleet.point_at(simulator)
    fleet.env |= {"FLEET_SHORT_CONCURRENCY": "50", "FLEET_WORKER_SHORT_CONCURRENCY": "4"}
    fleet.write_partition("p", prompts(24))
    fleet.producer("enqueue")
    assert fleet.start_worker("--burst").wait(timeout=60) == 0
    assert simulator.stats()["peak_in_flight"] == 4
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(24)])


def test_failover_when_one_of_two_servers_dies(fleet: Fleet, start_simulator: Start):
    first, second = start_simulator(*SLOW), start_simulator(*SLOW)
    fleet.point_at(first, second)
    fleet.write_partition("p", prompts(150))
    fleet.env["FLEET_SHORT_CONCURRENCY"] = "20"
    fleet.producer("enqueue")
    worker = fleet.start_worker()
    wait_until(lambda: first.stats()["completed"] >= 10 and second.stats()["completed"] >= 10, what="both serving")
    first.signal(signal.SIGKILL)
    wait_for_outputs(fleet, "p", 150, timeout=90)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert "is down" in worker.output()
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(150)])


def test_rq_info_shows_every_job_in_flight_as_started(fleet: Fleet, start_simulator: Start, redis_client):
    fleet.point_at(
        start_simulator("--token-latency", "0.05", "--min-output-tokens", "200", "--max-output-tokens", "200")
    )
    fleet.write_partition("p", prompts(12))
    fleet.producer("enqueue")
    worker = fleet.start_worker()
    wait_until(lambda: redis_client.zcard("rq:wip:short") == 12, what="12 jobs in flight")
    info = [sys.executable, "-m", "rq.cli", "info", "-u", fleet.env["FLEET_REDIS_URL"], "short"]
    shown = subprocess.run(info, cwd=ROOT, env=fleet.env, capture_output=True, text=True, timeout=30).stdout
    assert "short        | 0, 12 executing" in shown and "1 workers, 1 queues" in shown
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
