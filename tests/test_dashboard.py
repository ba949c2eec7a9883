"""rq-dashboard against the fleet's Redis, started as the README says: `rq-dashboard -u REDIS_URL`."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.harness import Fleet, ManagedProcess, RedisServer, Simulator, free_port, wait_until


def test_rq_dashboard_lists_the_fleets_queues_and_reads_its_jobs(
    fleet: Fleet, start_simulator: Callable[..., Simulator], redis_server: RedisServer, tmp_path: Path
):
    fleet.point_at(start_simulator())
    fleet.write_partition("p", [{"id": f"p-{n}", "prompt": f"Question {n}?"} for n in range(2)])
    fleet.write_partition("q", [{"id": f"q-{n}", "prompt": f"Other {n}?"} for n in range(3)])
    (fleet.data_dir / "partitions.toml").write_text('[q]\nqueue = "long"\n')
    fleet.producer("enqueue")
    assert fleet.start_worker("short", "--burst").wait(timeout=60) == 0
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "rq_dashboard",
        "-u",
        redis_server.url,
        "-b",
        "127.0.0.1",
        "-p",
        str(port),
    ]
    dashboard = ManagedProcess(command, tmp_path / "dashboard.log").start()
    base = f"http://127.0.0.1:{port}/0"

    def queues() -> dict[str, dict] | None:
        if not dashboard.alive():
            raise AssertionError(f"rq-dashboard exited:\n{dashboard.output()}")
        try:
            return {queue["name"]: queue for queue in httpx.get(f"{base}/data/queues.json", timeout=2).json()["queues"]}
        except httpx.HTTPError:
            return None

    try:
        listed = wait_until(queues, timeout=30, what="rq-dashboard to answer")
        assert (listed["short"]["count"], listed["short"]["finished_job_registry_count"]) == (0, 2)
        assert (listed["long"]["count"], listed["long"]["failed_job_registry_count"]) == (3, 0)
        # Job data and results are plain pickles: rq-dashboard reads them with RQ's default serializer.
        finished = httpx.get(f"{base}/data/jobs/short/finished/8/asc/1.json", timeout=5).json()
        assert sorted(job["id"] for job in finished["jobs"]) == [fleet.job_id("p", "p-0"), fleet.job_id("p", "p-1")]
        job = httpx.get(f"{base}/data/job/{fleet.job_id('q', 'q-0')}.json", timeout=5).json()
        assert (job["status"], job["description"], job["origin"]) == ("queued", "generate q/q-0", "long")
    finally:
        dashboard.kill()
