"""The Quick start's end-to-end run on the bundled sample partitions.

It starts a private redis-server (unless `--redis-url` names one) and the SGLang simulator, enqueues
every sample partition, runs two FleetWorkers until the queues are empty, exports the dataset for
SpecForge and verifies it token by token, exports the conversations too to show what re-tokenizing them
would change, and prints which export to hand to SpecForge. Everything it writes goes under `run/demo/`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from common.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "run" / "demo"
WORKERS = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(what: str, ready: callable, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            sys.exit(f"error: {what} did not start within {timeout:.0f}s; see the logs in {RUN}")
        time.sleep(0.1)


def start(args: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(RUN / log, "wb") as file:
        return subprocess.Popen(args, stdout=file, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def simulator_answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    args = parser.parse_args()

    shutil.rmtree(RUN, ignore_errors=True)
    (RUN / "redis").mkdir(parents=True)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        redis_url = args.redis_url
        if redis_url is None:
            port = free_port()
            redis_url = f"redis://127.0.0.1:{port}/0"
            command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(RUN / "redis")]
            processes.append(start([*command, "--appendonly", "yes"], "redis.log"))
        wait_for("redis-server", lambda: redis_answers(redis_url))

        sglang_url = f"http://127.0.0.1:{free_port()}"
        simulate = [sys.executable, "-m", "server", "simulate", "--port", sglang_url.rsplit(":", 1)[1]]
        processes.append(start([*simulate, "--token-latency", "0.0005"], "simulator.log"))
        wait_for("the SGLang simulator", lambda: simulator_answers(sglang_url))

        env = os.environ | {
            "FLEET_REDIS_URL": redis_url,
            "FLEET_SGLANG_URL": sglang_url,
            "FLEET_DATA_DIR": str(ROOT / "sample" / "data"),
            "FLEET_OUTPUT_DIR": str(RUN / "output"),
            "FLEET_TOKENIZER": str(ROOT / "sample" / "tokenizer"),
        }
        shown = Settings(redis_url=redis_url).redis_url_redacted
        print(f"redis {shown}, simulator {sglang_url}, outputs in {RUN / 'output'}\n")
        subprocess.run([sys.executable, "-m", "producer", "enqueue", "--partition", "all"], env=env, check=True)

        print(f"\nrunning {WORKERS} FleetWorkers until the queues are empty (logs in {RUN})")
        worker = [sys.executable, "-m", "worker", "short", "long", "--burst"]
        workers = [start(worker, f"worker-{number}.log", env) for number in range(WORKERS)]
        processes += workers
        for process in workers:
            if process.wait() != 0:
                sys.exit(f"error: a worker failed; see {RUN}/worker-*.log")

        producer = [sys.executable, "-m", "producer"]
        dataset, sharegpt = RUN / "dataset", RUN / "sharegpt"
        print("\nthe dataset for SpecForge, token ids exactly as generated:")
        subprocess.run([*producer, "export", "--out", str(dataset), "--strict"], env=env, check=True)
        subprocess.run([*producer, "verify", "--export", str(dataset)], env=env, check=True)
        print("\nthe same as conversations, which a trainer renders and tokenizes again:")
        subprocess.run([*producer, "export", "--out", str(sharegpt), "--format", "sharegpt"], env=env, check=True)
        subprocess.run(
            [*producer, "verify", "--partition", "chat", "--export", str(sharegpt), "--show", "3"], env=env, check=True
        )
        print(
            f"\nhand SpecForge {dataset}/*.jsonl (`--format specforge`, verified token-exact) as data.prompts_path;"
            f" {sharegpt} shows what re-tokenizing conversations would change"
        )
        return 0
    except subprocess.CalledProcessError as error:
        print(f"error: {' '.join(map(str, error.cmd[1:4]))} exited with {error.returncode}", file=sys.stderr)
        return 1
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
