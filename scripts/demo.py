"""The Quick start's end-to-end run on the bundled sample partitions (`scripts/demo.sh`).

It starts a private redis-server (unless `--redis-url` names one) and the SGLang simulator, enqueues
every sample partition, runs two FleetWorkers until the queues are empty, exports the dataset for
SpecForge and verifies it token by token, exports the conversations too to show what re-tokenizing them
would change, and prints which export to hand to SpecForge. Everything it writes goes under `run/demo/`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from common.settings import Settings
from tests.harness import ROOT, Fleet, ManagedProcess, RedisServer, Simulator

RUN = ROOT / "run" / "demo"
WORKERS = 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    args = parser.parse_args()

    shutil.rmtree(RUN, ignore_errors=True)
    (RUN / "redis").mkdir(parents=True)
    processes: list[ManagedProcess] = []
    try:
        redis_url = args.redis_url
        if redis_url is None:
            redis_server = RedisServer(RUN / "redis").start()
            processes.append(redis_server)
            redis_url = redis_server.url
        simulator = Simulator(RUN / "simulator.log", "--token-latency", "0.0005")
        processes.append(simulator.start())

        fleet = Fleet(RUN, redis_url, simulator.url, data_dir=ROOT / "sample" / "data", timings={})
        shown = Settings(redis_url=redis_url).redis_url_redacted
        print(f"redis {shown}, simulator {simulator.url}, outputs in {fleet.output_dir}\n")
        print(fleet.producer("enqueue", "--partition", "all").stdout)

        print(f"running {WORKERS} FleetWorkers until the queues are empty (logs in {RUN})")
        workers = [fleet.start_worker("short", "long", "--burst") for _ in range(WORKERS)]
        processes += workers
        if any(worker.wait(timeout=600) != 0 for worker in workers):
            sys.exit(f"error: a worker failed; see {RUN}/worker-*.log")

        dataset, sharegpt = RUN / "dataset", RUN / "sharegpt"
        print("\nthe dataset for SpecForge, token ids exactly as generated:")
        print(fleet.producer("export", "--out", str(dataset), "--strict").stdout, end="")
        print(fleet.producer("verify", "--export", str(dataset)).stdout)
        print("the same as conversations, which a trainer renders and tokenizes again:")
        print(fleet.producer("export", "--out", str(sharegpt), "--format", "sharegpt").stdout, end="")
        print(fleet.producer("verify", "--partition", "chat", "--export", str(sharegpt), "--show", "3").stdout)
        print(
            f"hand SpecForge {dataset}/*.jsonl (`--format specforge`, verified token-exact) as data.prompts_path;"
            f" {sharegpt} shows what re-tokenizing conversations would change"
        )
        return 0
    except (AssertionError, subprocess.TimeoutExpired) as error:
        print(f"error: {error}\n(logs in {RUN})", file=sys.stderr)
        return 1
    finally:
        for process in processes:
            process.kill()


if __name__ == "__main__":
    sys.exit(main())
