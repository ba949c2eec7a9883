"""Several hosts that share nothing but Redis, the object store and the server: every prompt exactly once."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Callable
from pathlib import Path

import orjson

from common.store import ObjectStore
from tests.harness import Fleet, SeaweedFS, Simulator, prompts, wait_until


def test_workers_on_separate_hosts_commit_every_prompt_once_to_the_object_store(
    fleet: Fleet, start_simulator: Callable[..., Simulator], seaweedfs: SeaweedFS, tmp_path: Path
):
    store_url = f"{seaweedfs.bucket(f'hosts-{uuid.uuid4().hex[:12]}')}/run"
    fleet.env |= {"FLEET_OUTPUT_DIR": store_url, "FLEET_S3_ENDPOINT_URL": seaweedfs.endpoint, **SeaweedFS.CREDENTIALS}
    fleet.point_at(start_simulator("--token-latency", "0.005"))
    fleet.write_partition("p", prompts(80))
    ids = [f"p-{n}" for n in range(80)]

    def host(name: str) -> tuple[Path, dict[str, str]]:
        """A working directory and a temporary directory of its own, as on another machine."""
        home = tmp_path / name
        (home / "tmp").mkdir(parents=True)
        return home, {"TMPDIR": str(home / "tmp"), "HOME": str(home)}

    producer_home, _ = host("producer")
    fleet.producer("enqueue", cwd=producer_home)
    workers = []
    for name in ("gpu-node-1", "gpu-node-2"):
        home, env = host(name)
        env["FLEET_WORKER_SHORT_CONCURRENCY"] = "6"
        workers.append(fleet.start_worker("--burst", env=env, cwd=home))
    store = ObjectStore(store_url, seaweedfs.endpoint)
    # One node dies mid-run; the other reaps its jobs once their leases lapse, and finishes the partition.
    wait_until(lambda: len(store.done("p")) >= 20, timeout=60, what="20 outputs")
    workers[0].signal(signal.SIGKILL)
    assert workers[1].wait(timeout=120) == 0

    records = [store.load("p", fleet.job_id("p", sample)) for sample in ids]
    assert all(record is not None and record.finish_reason["type"] == "stop" for record in records)
    assert len(list(store.sample_keys("p"))) == 80
    # Nothing was written to any host's disk: the outputs, the prompts and the rejects are in the object store.
    hosts = [tmp_path / name for name in ("producer", "gpu-node-1", "gpu-node-2")]
    assert not [path for home in hosts for path in home.rglob("*") if path.is_file()]
    assert {key.split("/", 1)[0] for key in store.keys("")} == {"samples", "prompts", "rejects"}

    # status counts what is done from the workers' counts (a worker killed between its commit and its
    # bookkeeping leaves one uncounted), and recounts it exactly from the object store.
    status = orjson.loads(fleet.producer("status", "--json", cwd=producer_home).stdout)["partitions"]["p"]
    assert (status["queued"], status["in_flight"], status["failed"]) == (0, 0, 0) and status["done"] <= 80
    recounted = orjson.loads(fleet.producer("status", "--json", "--recount", cwd=producer_home).stdout)
    assert recounted["partitions"]["p"]["done"] == 80

    export_home, _ = host("trainer")
    fleet.producer("export", "--out", str(export_home / "dataset"), "--strict", cwd=export_home)
    rows = [orjson.loads(line) for line in (export_home / "dataset" / "p.jsonl").read_bytes().splitlines()]
    assert [row["id"] for row in rows] == ids
    assert (
        "verify: all good, 80 outputs of 1 partition"
        in fleet.producer("verify", "--export", str(export_home / "dataset")).stdout
    )
