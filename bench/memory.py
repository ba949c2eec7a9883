"""Memory for N generations in flight: one FleetWorker process against `rq worker-pool -n N`.

A plain RQ worker holds one job at a time in a forked work horse, so N requests in flight take N
workers and N horses. Both sides run the same kind of job against the same slow simulator; memory is
sampled while N requests are in flight at the simulator, as the sum over the process tree of RSS
(pages shared between forks counted in each process, as `ps` shows them) and of PSS (shared pages
split between the processes that share them: the fair total).

    python -m bench.memory [--in-flight 182] [--pool-workers 32]

The pool side runs `--pool-workers` workers (182 forked workers do not fit a small machine well); its
per-job figure is scaled to `--in-flight` in the last column.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from redis import Redis
from rq import Queue

from bench.plain_job import generate
from tests.harness import ROOT, Fleet, RedisServer, Simulator, wait_until

SLOW = ["--token-latency", "0.05", "--min-output-tokens", "400", "--max-output-tokens", "400", "--max-running", "2000"]


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [pid]
    if children.exists():
        for child in children.read_text().split():
            found += tree(int(child))
    return found


def memory_mb(pid: int) -> tuple[float, float]:
    """Sum of RSS and of PSS over the process tree of `pid`, in MB."""
    rss = pss = 0
    for member in tree(pid):
        try:
            for line in Path(f"/proc/{member}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except FileNotFoundError:
            continue
    return rss / 1024, pss / 1024


def in_flight(simulator: Simulator) -> int:
    stats = simulator.stats()
    return stats["running"] + stats["queued"]


def peak_while_in_flight(pid: int, simulator: Simulator, count: int) -> tuple[float, float]:
    wait_until(lambda: in_flight(simulator) >= count, timeout=120, what=f"{count} requests in flight")
    samples = [memory_mb(pid) for _ in range(10)]
    return max(rss for rss, _ in samples), max(pss for _, pss in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", type=int, default=182)
    parser.add_argument("--pool-workers", type=int, default=32)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="fleet-memory-"))
    redis_server = RedisServer(directory).start()
    simulator = Simulator(directory / "simulator.log", *SLOW).start()
    fleet = Fleet(directory, redis_server.url, simulator.url)
    fleet.env |= {"FLEET_SHORT_CONCURRENCY": str(args.in_flight)}
    try:
        fleet.write_partition("p", [{"id": n, "input_ids": [5, n % 300 + 10, 6]} for n in range(args.in_flight * 2)])
        fleet.producer("enqueue")
        worker = fleet.start_worker("short")
        fleet_rss, fleet_pss = peak_while_in_flight(worker.pid, simulator, args.in_flight)
        fleet.stop()

        queue = Queue("plain", connection=Redis.from_url(redis_server.url))
        for n in range(args.pool_workers * 2):
            queue.enqueue(generate, simulator.url, [9, n % 300 + 10, 9], job_timeout=-1)
        base = in_flight(simulator)
        command = ["rq", "worker-pool", "-n", str(args.pool_workers), "-u", redis_server.url, "plain"]
        with open(directory / "pool.log", "wb") as log:
            pool = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            pool_rss, pool_pss = peak_while_in_flight(pool.pid, simulator, base + args.pool_workers)
        finally:
            pool.kill()
            subprocess.run(["pkill", "-9", "-s", str(pool.pid)], check=False)
    finally:
        fleet.stop()
        simulator.kill()
        redis_server.kill()

    scale = args.in_flight / args.pool_workers
    print(f"\n{'':<28}{'in flight':>10}{'RSS MB':>10}{'PSS MB':>10}{f'PSS at {args.in_flight}':>14}")
    print(f"{'FleetWorker (1 process)':<28}{args.in_flight:>10}{fleet_rss:>10.1f}{fleet_pss:>10.1f}{fleet_pss:>14.1f}")
    label = f"rq worker-pool -n {args.pool_workers}"
    print(f"{label:<28}{args.pool_workers:>10}{pool_rss:>10.1f}{pool_pss:>10.1f}{pool_pss * scale:>14.1f}")
    print(f"\nratio at {args.in_flight} in flight (pool PSS / FleetWorker PSS): {pool_pss * scale / fleet_pss:.1f}x")
    print(f"reproduce: python -m bench.memory --in-flight {args.in_flight} --pool-workers {args.pool_workers}")


if __name__ == "__main__":
    main()
