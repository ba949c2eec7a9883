"""FleetWorker against the SGLang simulator, side by side with a minimal asyncio client, in one run.

Measures, for the same prompts and the same simulator settings:
  (a) end-to-end throughput, fleet / baseline (target >= 0.97);
  (b) mean requests in flight at the server / configured caps in steady state (target >= 0.98);
  (c) peak RSS of one FleetWorker holding 150 + 32 requests in flight (target <= 200 MB);
  (d) worker CPU time per completed job (target <= 2 ms);
  (e) time from a server restart to full in-flight again (target <= 2 s).
The fleet's figures include everything it does per job that the baseline does not: Redis claim and
bookkeeping, leases, and an fsynced write-once commit.

    python -m bench.fleet [--prompts 4000] [--token-latency 0.01] [--output-tokens 100 300]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
from rq.job import Job

from bench.peak import PeakRss
from common.protocol.serializer import PlainPickle
from common.records import GenerationJob
from common.store import open_store
from tests.harness import ROOT, Fleet, RedisServer, Simulator, wait_until

SHORT, LONG = 150, 32


@dataclass
class Run:
    name: str
    jobs: int
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_rss_mb: float = 0.0
    in_flight: list[int] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.jobs / self.wall_s

    @property
    def mean_in_flight(self) -> float:
        return statistics.fmean(self.in_flight) if self.in_flight else 0.0


class Sampler(threading.Thread):
    """Polls the simulator's own count of requests in flight while the middle of a run goes on."""

    def __init__(self, simulator: Simulator, jobs: int) -> None:
        super().__init__(daemon=True)
        self.simulator, self.jobs = simulator, jobs
        self.base = simulator.stats()["completed"]
        self.samples: list[int] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.2):
            stats = self.simulator.stats()
            done = stats["completed"] - self.base
            # Steady state: past the ramp-up, and while more work waits than the caps can hold.
            if 0.1 * self.jobs <= done <= self.jobs - 2 * (SHORT + LONG):
                self.samples.append(stats["running"] + stats["queued"])


def wait_for_cpu(pid: int) -> float:
    """Reap `pid`; its CPU seconds."""
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"process {pid} failed")
    return usage.ru_utime + usage.ru_stime


def measure(name: str, jobs: int, simulator: Simulator, start: callable) -> Run:
    run = Run(name, jobs)
    sampler = Sampler(simulator, jobs)
    began = time.monotonic()
    sampler.start()
    pid = start()
    peak = PeakRss(pid)
    peak.start()
    run.cpu_s = wait_for_cpu(pid)
    run.wall_s = time.monotonic() - began
    run.peak_rss_mb = peak.stop()
    sampler.stopped.set()
    sampler.join()
    run.in_flight = sampler.samples
    return run


def restart_to_full(fleet: Fleet, simulator: Simulator, simulator_flags: list[str], directory: Path) -> float:
    """Seconds from a restarted server answering /health to the fleet holding its full in-flight count."""
    worker = fleet.start_worker()
    wait_until(lambda: _in_flight(simulator) >= SHORT + LONG, timeout=60, what="full in-flight")
    simulator.signal(signal.SIGKILL)
    simulator.process.wait()
    restarted = Simulator(directory / "simulator-restarted.log", *simulator_flags, port=simulator.port)
    restarted.start()  # returns as soon as /health answers
    up = time.monotonic()
    wait_until(lambda: _in_flight(restarted) >= SHORT + LONG, timeout=30, interval=0.02, what="in-flight again")
    elapsed = time.monotonic() - up
    worker.signal(signal.SIGTERM)
    worker.wait(timeout=120)
    restarted.kill()
    return elapsed


def _in_flight(simulator: Simulator) -> int:
    try:
        stats = simulator.stats()
    except httpx.HTTPError:
        return 0
    return stats["running"] + stats["queued"]


def write_partitions(fleet: Fleet, prompts: int, seed: int) -> None:
    rng = random.Random(seed)
    long_count = prompts * LONG // (SHORT + LONG)
    for name, count in (("short", prompts - long_count), ("long", long_count)):
        records = [{"id": n, "input_ids": [rng.randrange(10, 400) for _ in range(200)]} for n in range(count)]
        fleet.write_partition(name, records)
    # For the restart measurement, enough work to hold every slot of both queues for a while.
    fleet.write_partition("restart_short", [{"id": n, "input_ids": [7, n % 300 + 10, 9]} for n in range(3000)])
    fleet.write_partition("restart_long", [{"id": n, "input_ids": [8, n % 300 + 10, 9]} for n in range(1000)])
    (fleet.data_dir / "partitions.toml").write_text('[long]\nqueue = "long"\n[restart_long]\nqueue = "long"\n')


def baseline_prompts(fleet: Fleet, client, path: Path) -> None:
    """The enqueued jobs' exact input_ids and sampling params, for the baseline client."""
    store = open_store(fleet.settings())
    lines = []
    for partition in ("short", "long"):
        for queued in client.lrange(f"rq:queue:{partition}", 0, -1):
            job = Job.fetch(queued.decode(), connection=client, serializer=PlainPickle)
            args = GenerationJob.model_validate(job.kwargs)
            record = {
                "id": f"{partition}-{args.sample_id}",
                "queue": partition,
                "input_ids": store.read_prompt(args.prompt) if args.prompt else args.input_ids,
                "sampling_params": args.sampling_params,
            }
            lines.append(orjson.dumps(record))
    path.write_bytes(b"\n".join(lines) + b"\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4000)
    parser.add_argument("--token-latency", type=float, default=0.01)
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(100, 300), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    redis_server = RedisServer(directory).start()
    flags = ["--token-latency", str(args.token_latency), "--max-running", "1000"]
    flags += ["--min-output-tokens", str(args.output_tokens[0]), "--max-output-tokens", str(args.output_tokens[1])]
    simulator = Simulator(directory / "simulator.log", *flags).start()
    fleet = Fleet(directory, redis_server.url, simulator.url)
    for test_only in ("FLEET_HEARTBEAT_INTERVAL", "FLEET_LEASE_TTL", "FLEET_RETRY_BACKOFF", "FLEET_SHUTDOWN_GRACE"):
        fleet.env.pop(test_only)
    try:
        write_partitions(fleet, args.prompts, args.seed)
        fleet.producer("enqueue", "--partition", "short", "long")
        prompts_file = directory / "baseline-prompts.jsonl"
        baseline_prompts(fleet, redis_server.client(), prompts_file)

        client_command = [sys.executable, str(ROOT / "bench" / "baseline_client.py"), str(prompts_file)]
        client_command += [str(directory / "baseline-out.jsonl"), "--url", simulator.url]
        baseline = measure("baseline", args.prompts, simulator, lambda: subprocess.Popen(client_command, cwd=ROOT).pid)
        fleet_run = measure(
            "FleetWorker", args.prompts, simulator, lambda: fleet.start_worker("short", "long", "--burst").pid
        )
        produced = sum(len(fleet.outputs(name)) for name in ("short", "long"))
        if produced != args.prompts:
            sys.exit(f"the fleet committed {produced} of {args.prompts} outputs")

        fleet.producer("enqueue", "--partition", "restart_short", "restart_long")
        restart_s = restart_to_full(fleet, simulator, flags, directory)
    finally:
        fleet.stop()
        simulator.kill()
        redis_server.kill()

    caps = SHORT + LONG
    rows = [
        ("(a) throughput, jobs/s", fleet_run.throughput, baseline.throughput, "ratio >= 0.97"),
        ("(b) mean in flight / caps", fleet_run.mean_in_flight / caps, baseline.mean_in_flight / caps, ">= 0.98"),
        ("(c) peak RSS, MB", fleet_run.peak_rss_mb, baseline.peak_rss_mb, "<= 200"),
        ("(d) CPU per job, ms", 1000 * fleet_run.cpu_s / args.prompts, 1000 * baseline.cpu_s / args.prompts, "<= 2"),
        ("(e) restart to full in-flight, s", restart_s, float("nan"), "<= 2"),
    ]
    print(
        f"\n{args.prompts} prompts, {caps} in flight (150 short + 32 long), token latency {args.token_latency}s, "
        f"{args.output_tokens[0]}-{args.output_tokens[1]} output tokens; {os.cpu_count()} CPUs\n"
    )
    print(f"{'metric':<34}{'FleetWorker':>14}{'baseline':>14}{'fleet/base':>12}  target")
    for metric, ours, theirs, target in rows:
        ratio = ours / theirs if theirs == theirs and theirs else float("nan")
        print(f"{metric:<34}{ours:>14.3f}{theirs:>14.3f}{ratio:>12.3f}  {target}")
    print(
        f"\nreproduce: python -m bench.fleet --prompts {args.prompts} --token-latency {args.token_latency} "
        f"--output-tokens {args.output_tokens[0]} {args.output_tokens[1]}"
    )
    print(f"(peak RSS: VmHWM, bench/peak.py; CPU: user + system of the worker or client; files in {directory})")


if __name__ == "__main__":
    main()
