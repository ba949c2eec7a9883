"""End to end with real processes: producer, FleetWorkers, redis-server and the simulator, under faults.

Every test ends with the same check: one correct record per accepted prompt, none twice.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from rq.job import Job
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer

from common.protocol.keys import DUPLICATES_KEY, generation_lock_key, lease_key
from common.protocol.serializer import PlainPickle
from tests.harness import (
    ROOT,
    Fleet,
    ManagedProcess,
    RedisServer,
    Router,
    Simulator,
    Start,
    assert_exactly_once,
    counts,
    free_port,
    prompts,
    wait_for_outputs,
    wait_until,
)


def generations_per_prompt(simulator: Simulator) -> list[int]:
    return list(simulator.stats()["inputs"].values())


def test_exactly_once_end_to_end_with_two_workers(fleet: Fleet, start_simulator: Start):
    simulator = start_simulator("--token-latency", "0.001")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(120))
    fleet.write_partition("q", prompts(30, "q"))
    (fleet.data_dir / "partitions.toml").write_text('[q]\nqueue = "long"\n')
    fleet.producer("enqueue")
    workers = [fleet.start_worker("short", "long", "--burst") for _ in range(2)]
    assert all(worker.wait(timeout=120) == 0 for worker in workers)

    records = assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(120)])
    assert_exactly_once(fleet, "q", [f"q-{n}" for n in range(30)])
    assert max(generations_per_prompt(simulator)) == 1
    assert {record["sampling_params"]["max_new_tokens"] for record in records} == {10240}
    # The record is what the server generated for exactly this prompt.
    for record in records[:3]:
        digest = hashlib.sha1(orjson.dumps(record["input_ids"])).hexdigest()
        assert digest in simulator.stats()["inputs"]
    # A re-run finds everything done.
    assert counts(fleet.enqueued()) == (120, 120, 0, 0, 0, 0)


@pytest.mark.parametrize("fault", ["--abort-rate", "--error-rate"])
def test_aborts_and_503s_are_retried_not_committed(fleet: Fleet, start_simulator: Start, fault: str):
    simulator = start_simulator(fault, "0.3", "--seed", "3")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(40))
    fleet.producer("enqueue")
    worker = fleet.start_worker("--burst", env={"FLEET_MAX_ATTEMPTS": "20"})
    assert worker.wait(timeout=120) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(40)])
    stats = simulator.stats()
    assert stats["aborted"] + stats["errors"] > 0


def test_server_refusing_connections_holds_jobs_until_it_answers(fleet: Fleet, start_simulator: Start, tmp_path: Path):
    port = Simulator(tmp_path / "unused.log").port
    fleet.env["FLEET_SGLANG_URL"] = f"http://127.0.0.1:{port}"
    fleet.write_partition("p", prompts(20))
    fleet.producer("enqueue")
    worker = fleet.start_worker("--burst")
    wait_until(lambda: "not dequeuing" in worker.output(), what="the worker to wait for a server")
    assert worker.alive() and len(fleet.outputs("p")) == 0

    start_simulator(port=port)
    assert worker.wait(timeout=60) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(20)])


def test_http_400_fails_the_job_with_the_servers_message(fleet: Fleet, start_simulator: Start, redis_client):
    simulator = start_simulator("--context-length", "60")
    fleet.point_at(simulator)
    fleet.write_partition("p", [{"id": "short", "input_ids": [5] * 10}, {"id": "long", "input_ids": [5] * 80}])
    fleet.env["FLEET_SHORT_MAX_NEW_TOKENS"] = "16"
    fleet.producer("enqueue")
    assert fleet.start_worker("--burst").wait(timeout=60) == 0

    assert [record["id"] for record in fleet.outputs("p")] == ["short"]
    failed = FailedJobRegistry("short", connection=redis_client, serializer=PlainPickle)
    assert failed.get_job_ids() == [fleet.job_id("p", "long")]
    job = Job.fetch(fleet.job_id("p", "long"), connection=redis_client, serializer=PlainPickle)
    assert "HTTP 400" in job.latest_result().exc_string
    # A re-run of enqueue leaves the failed job alone.
    assert counts(fleet.enqueued()) == (2, 1, 0, 1, 0, 0)


def test_server_killed_mid_run_and_restarted(fleet: Fleet, start_simulator: Start):
    simulator = start_simulator("--exit-after", "25", "--token-latency", "0.002")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(80))
    fleet.producer("enqueue")
    worker = fleet.start_worker("--burst")
    wait_until(lambda: not simulator.alive(), what="the simulator to crash")
    assert 0 < len(fleet.outputs("p")) < 80
    start_simulator(port=simulator.port)
    assert worker.wait(timeout=90) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(80)])


def test_only_the_prompt_that_crashes_the_server_fails(fleet: Fleet, start_simulator: Start, redis_client):
    """The server dies whenever one prompt reaches it, taking every request in flight with it. Probation tries
    the jobs that were in flight in ever smaller groups: the prompt alone fails, as crashing the server, after
    a handful of crashes, and every other prompt is generated once."""
    flags = ("--crash-on-token", "401", "--token-latency", "0.005")
    flags += ("--min-output-tokens", "40", "--max-output-tokens", "80")
    simulator = start_simulator(*flags)
    fleet.point_at(simulator)
    fleet.env["FLEET_SHORT_CONCURRENCY"] = "16"
    records = [{"id": n, "input_ids": [5, n + 10, 9]} for n in range(60)]
    records[37]["input_ids"] = [5, 401, 9]
    fleet.write_partition("p", records)
    fleet.producer("enqueue")
    worker = fleet.start_worker("--burst")
    crashes = 0
    while True:
        wait_until(lambda s=simulator: not worker.alive() or not s.alive(), timeout=60, what="the run or a crash")
        if not worker.alive():
            break
        crashes += 1
        simulator = start_simulator(*flags, port=simulator.port)

    assert worker.wait(timeout=0) == 0
    assert sorted(record["id"] for record in fleet.outputs("p")) == [n for n in range(60) if n != 37]
    failed = FailedJobRegistry("short", connection=redis_client, serializer=PlainPickle)
    assert failed.get_job_ids() == [fleet.job_id("p", 37)]
    job = Job.fetch(fleet.job_id("p", 37), connection=redis_client, serializer=PlainPickle)
    blame = "CrashesTheServer: the server went down 2 times while this prompt ran alone"
    assert blame in job.latest_result().exc_string
    # The first crash, one with all 16 in probation, a few while its groups shrink (12, 3, 1), two with it alone.
    assert 3 <= crashes <= 8, crashes
    assert redis_client.llen("rq:queue:probation") == 0


def test_sigkilled_worker_jobs_are_requeued_and_finished(fleet: Fleet, start_simulator: Start, redis_client):
    # Slow generations, so that the first worker dies with jobs in flight.
    simulator = start_simulator("--token-latency", "0.02", "--min-output-tokens", "100", "--max-output-tokens", "100")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(30))
    fleet.producer("enqueue")
    doomed = fleet.start_worker()
    # ZCARD, not registry.count: RQ's count runs its own cleanup, which would do the requeueing itself.
    wip = "rq:wip:short"
    wait_until(lambda: redis_client.zcard(wip) >= 30, what="30 jobs in flight")
    doomed.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    # What a writer killed between writing its temporary file and linking it leaves, long ago.
    leftover = fleet.output_dir / ".tmp" / "p--p-0--x.json.4242.0a1b"
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(b'{"half a rec')
    day_ago = time.time() - 86_400
    os.utime(leftover, (day_ago, day_ago))

    survivor = fleet.start_worker()

    def requeued() -> int:
        return sum(int(count) for count in re.findall(r"requeued (\d+) jobs of short", survivor.output()))

    # The leases (3 s in tests) lapse; once they have stayed lapsed a lease longer, the survivor's reaper
    # requeues the jobs (in one round or a few) and it claims them again.
    wait_until(lambda: requeued() >= 30, timeout=30, what="the reaper")
    assert requeued() == 30
    assert time.monotonic() - killed_at < 2 * 3 + 2 * 0.5 + 5
    wait_for_outputs(fleet, "p", 30)
    survivor.signal(signal.SIGTERM)
    assert survivor.wait(timeout=30) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(30)])
    assert redis_client.zcard(wip) == 0 and not leftover.exists()
    assert "removed 1 temporary files that killed writers left" in survivor.output()
    # Reaping spends none of the job's retry budget.
    assert Job.fetch(fleet.job_id("p", "p-0"), connection=redis_client, serializer=PlainPickle).retries_left == 100


def test_redis_restarted_empty_mid_run_is_recovered_by_reenqueue(
    fleet: Fleet, start_simulator: Start, redis_server: RedisServer
):
    simulator = start_simulator("--token-latency", "0.01", "--min-output-tokens", "50", "--max-output-tokens", "50")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(60))
    fleet.producer("enqueue")
    worker = fleet.start_worker(env={"FLEET_SHORT_CONCURRENCY": "10"})
    wait_for_outputs(fleet, "p", 5)
    redis_server.restart()  # no persistence: every job, queue and registry is gone

    total, done, pending, failed, enqueued, rejected = counts(fleet.enqueued())
    assert (total, pending, failed, rejected) == (60, 0, 0, 0)
    assert done + enqueued == 60 and enqueued > 0
    wait_for_outputs(fleet, "p", 60)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(60)])
    # Samples in flight during the restart may have been generated twice; only the first commit counts.
    duplicates = int(redis_server.client().get(DUPLICATES_KEY) or 0)
    assert sum(count - 1 for count in generations_per_prompt(simulator)) >= duplicates


def test_sigterm_lets_jobs_finish_then_requeues_the_rest(fleet: Fleet, start_simulator: Start, redis_client):
    simulator = start_simulator("--token-latency", "0.05", "--min-output-tokens", "100", "--max-output-tokens", "100")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(10))
    fleet.producer("enqueue")
    worker = fleet.start_worker(env={"FLEET_SHUTDOWN_GRACE": "0.5"})
    started = StartedJobRegistry("short", connection=redis_client, serializer=PlainPickle)
    wait_until(lambda: started.count == 10, what="10 jobs in flight")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert "requeued 10 unfinished jobs" in worker.output()
    assert redis_client.llen("rq:queue:short") == 10
    assert FailedJobRegistry("short", connection=redis_client).count == 0

    patient = fleet.start_worker("--burst")
    assert patient.wait(timeout=60) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(10)])


def queue_raw_job(client: redis.Redis, identifier: str, function: str, **arguments: Any) -> None:
    """Put a job into the short queue by hand, as anyone with access to Redis could, bypassing the producer."""
    options = {"id": identifier, "origin": "short", "serializer": JSONSerializer, "status": "queued"}
    job = Job.create(function, connection=client, **options, **arguments)
    job.save()
    client.rpush("rq:queue:short", identifier)


def test_worker_runs_nothing_but_the_generation_job(fleet: Fleet, start_simulator: Start, redis_client, tmp_path):
    fleet.point_at(start_simulator())
    marker = tmp_path / "pwned"
    queue_raw_job(redis_client, "evil", "os.system", args=[f"touch {marker}"])
    assert fleet.start_worker("--burst").wait(timeout=30) == 0
    assert not marker.exists()
    failure = Job.fetch("evil", connection=redis_client, serializer=PlainPickle).latest_result().exc_string
    assert "FleetWorker runs only worker.jobs.generate" in failure


def test_rq_worker_typed_as_is_generates_every_prompt_once(fleet: Fleet, start_simulator: Start):
    simulator = start_simulator("--max-output-tokens", "32")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(6))
    fleet.write_partition("q", [{"id": f"q-{n}", "prompt": f"Long question {n}?"} for n in range(3)])
    (fleet.data_dir / "partitions.toml").write_text('[q]\nqueue = "long"\n')
    fleet.producer("enqueue")
    # No -w, no RQ_WORKER_CLASS: RQ's own worker with its defaults (pickle), one job at a time.
    command = [sys.executable, "-m", "rq.cli", "worker", "--burst", "-u", fleet.env["FLEET_REDIS_URL"], "short", "long"]
    result = subprocess.run(command, cwd=ROOT, env=fleet.env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (result.stdout + result.stderr).count("a plain RQ worker runs one generation at a time") == 1
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(6)])
    assert_exactly_once(fleet, "q", [f"q-{n}" for n in range(3)])
    assert orjson.loads(fleet.producer("status", "--json").stdout)["partitions"]["p"]["done"] == 6
    # Run again, it finds every sample committed and generates nothing.
    fleet.producer("enqueue")
    requests = simulator.stats()["requests"]
    assert subprocess.run(command, cwd=ROOT, env=fleet.env, capture_output=True, timeout=60).returncode == 0
    assert simulator.stats()["requests"] == requests


def test_a_wrong_api_key_stops_the_worker_without_failing_jobs(fleet: Fleet, start_simulator: Start, redis_client):
    fleet.point_at(start_simulator("--api-key", "right"))
    fleet.write_partition("p", prompts(10))
    fleet.producer("enqueue")
    worker = fleet.start_worker("--burst", env={"FLEET_SGLANG_API_KEY": "wrong"})
    assert worker.wait(timeout=60) == 1
    assert "check FLEET_SGLANG_API_KEY" in worker.output() and "wrong" not in worker.output()
    assert FailedJobRegistry("short", connection=redis_client).count == 0
    assert redis_client.llen("rq:queue:short") == 10

    assert fleet.start_worker("--burst", env={"FLEET_SGLANG_API_KEY": "right"}).wait(timeout=60) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(10)])


def test_unreadable_or_hostile_jobs_fail_alone(fleet: Fleet, start_simulator: Start, redis_client, tmp_path):
    fleet.point_at(start_simulator())
    fleet.write_partition("p", prompts(5))
    fleet.producer("enqueue")
    # A job hash with no data at all, and a job whose partition would lead outside the output store.
    redis_client.hset("rq:job:broken", mapping={"status": "queued", "origin": "short"})
    redis_client.rpush("rq:queue:short", "broken")
    escaping = {"partition": "../escaped", "sample_id": 1, "input_ids": [5, 6], "sampling_params": {}}
    queue_raw_job(redis_client, "escape", "worker.jobs.generate", kwargs=escaping)
    assert fleet.start_worker("--burst").wait(timeout=60) == 0

    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(5)])
    failed = FailedJobRegistry("short", connection=redis_client, serializer=PlainPickle)
    assert sorted(failed.get_job_ids()) == ["broken", "escape"]
    assert not (fleet.output_dir / "escaped").exists() and not (tmp_path / "escaped").exists()


def test_an_unwritable_output_dir_stops_the_worker_before_any_generation(fleet: Fleet, tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    worker = fleet.start_worker("--burst", env={"FLEET_OUTPUT_DIR": str(blocker / "output")})
    assert worker.wait(timeout=30) == 1
    assert worker.output().strip().splitlines()[-1].startswith("error: FLEET_OUTPUT_DIR: cannot write outputs")


def test_redis_refusing_writes_for_a_while_loses_nothing(
    fleet: Fleet, start_simulator: Start, redis_client: redis.Redis
):
    simulator = start_simulator("--token-latency", "0.01", "--min-output-tokens", "30", "--max-output-tokens", "30")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(60))
    fleet.producer("enqueue")
    worker = fleet.start_worker(env={"FLEET_SHORT_CONCURRENCY": "10"})
    wait_for_outputs(fleet, "p", 5)
    redis_client.config_set("maxmemory", "1")  # every write now fails with OOM, as under `noeviction`
    try:
        wait_until(lambda: "Redis unavailable" in worker.output(), what="the worker to meet the OOM errors")
    finally:
        redis_client.config_set("maxmemory", "0")
    wait_for_outputs(fleet, "p", 60)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(60)])
    assert max(generations_per_prompt(simulator)) == 1


def test_the_rq_command_line_runs_fleet_workers(fleet: Fleet, start_simulator: Start):
    fleet.point_at(start_simulator())
    fleet.write_partition("p", prompts(20))
    fleet.producer("enqueue")
    rq_worker = [
        sys.executable,
        "-m",
        "rq.cli",
        "worker",
        "-u",
        fleet.env["FLEET_REDIS_URL"],
        "--burst",
        "short",
        "long",
    ]
    by_flag = subprocess.run([*rq_worker, "-w", "worker.FleetWorker"], cwd=ROOT, env=fleet.env, timeout=60, check=False)
    assert by_flag.returncode == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(20)])

    fleet.write_partition("p", prompts(30))
    fleet.producer("enqueue")
    by_variable = fleet.env | {"RQ_WORKER_CLASS": "worker.FleetWorker"}
    assert subprocess.run(rq_worker, cwd=ROOT, env=by_variable, timeout=60, check=False).returncode == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(30)])


def test_the_supervisor_brings_a_killed_server_back_and_nothing_is_lost(fleet: Fleet, tmp_path: Path):
    port = free_port()
    no_gpu_processes = tmp_path / "gpus.json"
    no_gpu_processes.write_text('{"gpus": [{"total_gib": 96, "processes": []}]}')
    simulate = [sys.executable, "-m", "server", "simulate", "--host", "{host}", "--port", "{port}"]
    simulate += ["--token-latency", "0.01", "--min-output-tokens", "30", "--max-output-tokens", "30"]
    supervisor_env = fleet.env | {
        "FLEET_SERVER_COMMAND": shlex.join(simulate),
        "FLEET_SERVER_PORT": str(port),
        "FLEET_SERVER_LOG": str(tmp_path / "sglang.log"),
        "FLEET_GPU_PROBE_FILE": str(no_gpu_processes),
        "FLEET_HEALTH_INTERVAL": "0.2",
        "FLEET_RESTART_BACKOFF": "0.1",
    }
    supervise = [sys.executable, "-m", "server", "supervise"]
    supervisor = ManagedProcess(supervise, tmp_path / "supervise.out", supervisor_env).start()
    try:
        fleet.env["FLEET_SGLANG_URL"] = f"http://127.0.0.1:{port}"
        fleet.write_partition("p", prompts(80))
        fleet.producer("enqueue")
        worker = fleet.start_worker(env={"FLEET_SHORT_CONCURRENCY": "20"})
        wait_for_outputs(fleet, "p", 10)
        server_group = int(re.search(r"started process group (\d+)", supervisor.output()).group(1))
        os.killpg(server_group, signal.SIGKILL)
        wait_until(lambda: "server exited" in supervisor.output(), what="the supervisor to see the crash")
        wait_for_outputs(fleet, "p", 80)
        assert supervisor.output().count("started process group") == 2
        worker.signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
        assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(80)])
    finally:
        supervisor.signal(signal.SIGTERM)
        supervisor.wait(timeout=30)


@pytest.mark.parametrize("status", ["429", "503", "504"])
def test_requests_turned_away_are_sent_again_at_no_cost(fleet: Fleet, start_simulator: Start, status: str):
    # A router's full queue (429 with Retry-After), SGLang refusing one request (503), a proxy (504): none
    # says the server is down, and none costs the job an attempt, though only one attempt is allowed.
    simulator = start_simulator("--error-rate", "0.5", "--error-status", status, "--retry-after", "0.05")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(30))
    fleet.producer("enqueue")
    worker = fleet.start_worker("--burst", env={"FLEET_MAX_ATTEMPTS": "1"})
    assert worker.wait(timeout=120) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(30)])
    assert simulator.stats()["errors"] > 10
    assert "is down" not in worker.output() and f"HTTP {status}" in worker.output()


def test_behind_a_loaded_sglang_router_every_prompt_is_generated_once_and_none_fails(
    fleet: Fleet, start_simulator: Start, tmp_path: Path
):
    # The real router with a small admission queue: 4 requests at a time, 4 waiting at most 2 s; the rest are
    # turned away (sglang-router 0.3.2 answers 408 then; a router may also answer 429). The worker sends 16 at once,
    # and may spend only one attempt on each job.
    backends = [start_simulator("--token-latency", "0.01", "--max-output-tokens", "40") for _ in range(2)]
    flags = ("--max-concurrent-requests", "4", "--queue-size", "4", "--queue-timeout-secs", "2")
    flags += ("--policy", "round_robin")  # its default, cache-aware, sends these alike prompts all to one
    router = Router(tmp_path / "router.log", backends, *flags).start()
    try:
        fleet.point_at(router)
        fleet.write_partition("p", prompts(60))
        fleet.producer("enqueue")
        worker = fleet.start_worker("--burst", env={"FLEET_SHORT_CONCURRENCY": "16", "FLEET_MAX_ATTEMPTS": "1"})
        assert worker.wait(timeout=180) == 0
    finally:
        router.kill()
    # A router names the model but not its backends' SGLang version.
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(60)], server_version="")
    turned_away = re.findall(r"turned away \(\S+: HTTP (\d+)", worker.output())
    assert turned_away and set(turned_away) <= {"429", "408"}
    generated = [sum(generations_per_prompt(backend)) for backend in backends]
    assert sum(generated) == 60 and min(generated) > 0


def test_redis_busy_with_a_long_script_stops_nothing(fleet: Fleet, start_simulator: Start, redis_client: redis.Redis):
    fleet.point_at(start_simulator("--token-latency", "0.005"))
    fleet.write_partition("p", prompts(40))
    fleet.producer("enqueue")
    worker = fleet.start_worker("--burst")
    wait_for_outputs(fleet, "p", 5)
    # A script running past busy-reply-threshold (a `cancel` of a huge queue, say): every other client is
    # answered BUSY until it ends.
    redis_client.config_set("busy-reply-threshold", 100)
    try:
        spin = "local stop = redis.call('TIME')[1] + 2 while tonumber(redis.call('TIME')[1]) < stop do end return 1"
        redis_client.eval(spin, 0)
    finally:
        redis_client.config_set("busy-reply-threshold", 5000)
    assert worker.wait(timeout=60) == 0
    assert "BUSY Redis is busy running a script" in worker.output()
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(40)])


def test_redis_frozen_longer_than_two_leases_runs_no_job_twice(
    fleet: Fleet, start_simulator: Start, redis_server: RedisServer, redis_client: redis.Redis
):
    simulator = start_simulator("--token-latency", "0.05", "--min-output-tokens", "60", "--max-output-tokens", "80")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(12))
    fleet.producer("enqueue")
    worker = fleet.start_worker("--burst", env={"FLEET_REDIS_TIMEOUT": "1"})
    wait_until(lambda: redis_client.zcard(lease_key("short")) == 12, what="12 jobs in flight")
    # A long AOF rewrite, a failover or a paused VM: Redis answers nothing for 8 s, leases are 3 s.
    redis_server.signal(signal.SIGSTOP)
    time.sleep(8)
    redis_server.signal(signal.SIGCONT)
    assert worker.wait(timeout=60) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(12)])
    # Every lease lapsed on Redis's clock; none was reaped, since the live worker renewed them all in time.
    assert sorted(simulator.stats()["inputs"].values()) == [1] * 12
    assert "whose worker stopped renewing" not in worker.output()


def test_an_execution_whose_lock_another_took_stops_and_leaves_the_sample_to_it(
    fleet: Fleet, start_simulator: Start, redis_client: redis.Redis
):
    simulator = start_simulator("--token-latency", "0.05", "--min-output-tokens", "100", "--max-output-tokens", "100")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(3))
    fleet.producer("enqueue")
    worker = fleet.start_worker()
    wait_until(lambda: simulator.stats()["running"] == 3, what="3 generations running")
    # The lock key vanished (Redis failed over to a replica that had not seen it) and a second execution of
    # p-0, claimed from a copy of its job, took it before this one renewed it.
    stolen = fleet.job_id("p", "p-0")
    redis_client.set(generation_lock_key(stolen), "another-execution", ex=60)

    wait_until(lambda: simulator.stats()["disconnected"] == 1, what="the generation of p-0 to stop")
    assert f"another execution took the generation lock of {stolen}" in worker.output()
    leases = redis_client.zrange(lease_key("short"), 0, -1)
    assert len(leases) == 2 and not any(member.startswith(stolen.encode()) for member in leases)
    wait_for_outputs(fleet, "p", 2)
    assert "p-0" not in {record["id"] for record in fleet.outputs("p")}
    # Now that execution dies, and its job comes back: this worker generates p-0 after all, once.
    redis_client.delete(generation_lock_key(stolen))
    redis_client.hset(f"rq:job:{stolen}", "status", "queued")
    redis_client.lpush("rq:queue:short", stolen)
    wait_for_outputs(fleet, "p", 3)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(3)])


def test_rq_cleanup_from_a_host_whose_clock_is_ahead_requeues_no_live_job(
    fleet: Fleet, start_simulator: Start, redis_client: redis.Redis
):
    simulator = start_simulator("--token-latency", "0.05", "--min-output-tokens", "40", "--max-output-tokens", "40")
    fleet.point_at(simulator)
    fleet.write_partition("p", prompts(6))
    fleet.producer("enqueue")
    worker = fleet.start_worker("--burst")
    started = StartedJobRegistry("short", connection=redis_client, serializer=PlainPickle)
    wait_until(lambda: started.count == 6, what="6 jobs in flight")
    # What `rq info` or rq-dashboard runs, on a host 60 s ahead.
    started.cleanup(timestamp=time.time() + 60)
    assert started.count == 6 and redis_client.llen("rq:queue:short") == 0
    assert worker.wait(timeout=60) == 0
    assert_exactly_once(fleet, "p", [f"p-{n}" for n in range(6)])
    assert sorted(simulator.stats()["inputs"].values()) == [1] * 6
