"""What a new user meets first: workers that say where they are, a status that tells the truth, forgiving input."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable

import orjson
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from common.protocol.keys import JOB_FUNCTION, job_id, worker_state_key
from tests.harness import ROOT, Fleet, Simulator, free_port, wait_until

Start = Callable[..., Simulator]


def test_a_worker_names_its_redis_and_servers_and_refuses_another_redis(fleet: Fleet, start_simulator: Start):
    simulator = start_simulator()
    fleet.point_at(simulator)
    worker = fleet.start_worker()
    wait_until(lambda: "FleetWorker" in worker.output(), what="the banner")
    port = fleet.env["FLEET_REDIS_URL"].rsplit(":", 1)[1].split("/")[0]
    banner = next(line for line in worker.output().splitlines() if "FleetWorker" in line)
    assert f"on Redis redis://127.0.0.1:{port}/0: short x150 (fleet cap 150)" in banner and simulator.url in banner
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert "no healthy server" not in worker.output()

    # `rq worker --url` pointing elsewhere than FLEET_REDIS_URL: the producer's jobs would never come.
    elsewhere = fleet.env["FLEET_REDIS_URL"].replace("/0", "/3")
    command = [sys.executable, "-m", "rq.cli", "worker", "-w", "worker.FleetWorker", "-u", elsewhere, "--burst"]
    result = subprocess.run(command, cwd=ROOT, env=fleet.env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert f"this worker's Redis is redis://127.0.0.1:{port}/3" in result.stderr
    assert f"but FLEET_REDIS_URL is redis://127.0.0.1:{port}/0" in result.stderr


def test_no_healthy_server_is_said_once_probed_with_each_url_and_its_error(fleet: Fleet):
    down = f"http://127.0.0.1:{free_port()}"
    fleet.env["FLEET_SGLANG_URL"] = down
    worker = fleet.start_worker()
    line = wait_until(
        lambda: next((line for line in worker.output().splitlines() if "no healthy server" in line), None),
        what="the no-healthy-server line",
    )
    assert f"{down}: ClientConnectorError" in line
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0


def test_a_cleanly_stopped_worker_leaves_status_at_once(
    fleet: Fleet, start_simulator: Start, redis_client: redis.Redis
):
    fleet.point_at(start_simulator())
    worker = fleet.start_worker()
    wait_until(lambda: redis_client.keys(worker_state_key("*")), what="the worker's first report")
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert redis_client.keys(worker_state_key("*")) == []
    status = orjson.loads(fleet.producer("status", "--json").stdout)
    assert status["workers"] == [] and not any("not registered" in problem for problem in status["problems"])


def test_jobs_a_plain_rq_worker_cannot_read_fail_with_the_fix_and_the_worker(fleet: Fleet, redis_client: redis.Redis):
    # Jobs written as JSON (by an earlier version): RQ's own worker, which reads pickle, cannot run them.
    for n in range(2):
        arguments = {"partition": "p", "sample_id": n, "input_ids": [1, 2], "sampling_params": {}}
        job = Job.create(JOB_FUNCTION, kwargs=arguments, connection=redis_client, id=job_id("p", n), origin="short",
                         serializer=JSONSerializer, status="queued")  # fmt: skip
        job.save()
        redis_client.rpush("rq:queue:short", job.id)
    command = [
        sys.executable,
        "-m",
        "rq.cli",
        "worker",
        "--burst",
        "-n",
        "plain-one",
        "-u",
        fleet.env["FLEET_REDIS_URL"],
    ]
    subprocess.run([*command, "short"], cwd=ROOT, env=fleet.env, capture_output=True, timeout=60, check=False)
    status = orjson.loads(fleet.producer("status", "--json").stdout)
    [failure] = status["failures"]
    assert failure["count"] == 2 and failure["workers"] == ["plain-one"] and "DeserializationError" in failure["cause"]
    assert "rq worker -w worker.FleetWorker" in failure["fix"] and "retry-failed" in failure["fix"]
    assert "fix: a plain RQ worker took these jobs" in fleet.producer("status").stdout


def test_input_friction(fleet: Fleet, redis_client: redis.Redis):
    # A UTF-8 BOM, as Notepad writes one; files that are not partitions; an empty partition.
    (fleet.data_dir / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"id": "first", "prompt": "Hi"}\n')
    (fleet.data_dir / "empty.jsonl").write_bytes(b"")
    (fleet.data_dir / "UPPER.JSONL").write_text("")
    (fleet.data_dir / "array.json").write_text("[]")
    result = fleet.producer("enqueue")
    assert "note: skipped UPPER.JSONL, array.json in" in result.stderr
    assert f"empty: no records in {fleet.data_dir / 'empty'}.jsonl" in result.stdout
    summary = fleet.producer_json("enqueue")["partitions"]
    assert (summary["bom"]["rejected"], summary["bom"]["pending"]) == (0, 1)
    header, bom, _ = fleet.producer("enqueue").stdout.splitlines()[:3]
    assert header.split()[3] == "queued/running" and bom.split()[3] == "1"  # after enqueueing

    # Every command refuses a partition it does not know, the same way, and creates nothing first.
    for command in (["cancel"], ["retry-failed"], ["export", "--out", str(fleet.directory / "out")], ["verify"]):
        result = fleet.producer(*command, "--partition", "nosuch", check=False)
        assert result.returncode == 2 and result.stderr.startswith("error: unknown partition(s) nosuch in "), result
    assert not (fleet.directory / "out").exists()

    fleet.env["FLEET_DATA_DIR"] = str(fleet.directory / "nowhere")
    assert "note: FLEET_DATA_DIR" in fleet.producer("status").stdout
