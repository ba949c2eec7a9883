"""A million prompts: enqueue rate, Redis memory per pending job, `status` time, and export/verify memory.

Each figure beside its alternative, measured in the same run:
1. `python -m producer enqueue` of PROMPTS pre-tokenized prompts of TOKENS tokens (their ids go to the output
   store, each job refers to its prompt), against RQ's own `enqueue_many` of COMPARE jobs carrying the ids
   inline as the fleet's jobs did before: enqueue rate, and Redis memory per pending job from INFO memory.
2. With OUTPUTS outputs committed (built through the store interface, not generated, on a tmpfs store:
   short records, since what is measured does not grow with them), `status --json` from the done counts
   the workers keep, against `status --json --recount`, which counts the store's records.
3. Peak RSS of `export` and `verify --export` over OUTPUTS outputs against the same over a tenth of them:
   both stream in input order, so the ratio stays near 1.

    python -m bench.scale [--prompts 1000000] [--tokens 2000] [--outputs 1000000] [--compare 20000]
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
from rq import Queue
from rq.serializers import JSONSerializer

from bench.peak import PeakRss
from common.protocol.keys import JOB_FUNCTION, job_id
from common.records import OutputRecord
from common.store import LocalStore
from tests.harness import ROOT, Fleet, RedisServer

# Token ids below the sample tokenizer's vocabulary (449), which enqueue checks prompts against.
VOCABULARY = 440
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": -1, "min_p": 0.0, "max_new_tokens": 10240}


def run(fleet: Fleet, *args: str) -> tuple[float, float]:
    """Seconds and peak RSS (MB) of `python -m producer ARGS`, as its own process."""
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "producer", *args], env=fleet.env, cwd=ROOT, stdout=subprocess.DEVNULL
    )
    peak = PeakRss(process.pid)
    peak.start()
    if process.wait() != 0:
        sys.exit(f"python -m producer {' '.join(args)} failed")
    return time.perf_counter() - began, peak.stop()


def write_prompts(path: Path, count: int, tokens: int, seed: int) -> list[list[int]]:
    """`count` pre-tokenized prompts; each begins with its number in base VOCABULARY, so no two are alike."""
    rng = random.Random(seed)
    body = [rng.randrange(7, VOCABULARY) for _ in range(tokens)]
    kept = []
    with open(path, "wb") as file:
        for n in range(count):
            ids = [7 + n // VOCABULARY**2 % 400, 7 + n // VOCABULARY % 400, 7 + n % 400, *body[3:]]
            file.write(orjson.dumps({"id": n, "input_ids": ids}) + b"\n")
            if n < 1000:
                kept.append(ids)
    return kept


def used_memory(fleet: Fleet, redis_server: RedisServer) -> int:
    return int(redis_server.client().info("memory")["used_memory"])


def enqueue_figures(args: argparse.Namespace, directory: Path) -> dict[str, float]:
    (directory / "redis").mkdir(exist_ok=True)
    redis_server = RedisServer(directory / "redis").start()
    fleet = Fleet(directory, redis_server.url)
    fleet.env["FLEET_OUTPUT_DIR"] = str(directory / "store")
    try:
        print(f"writing {args.prompts:,} prompts of {args.tokens} tokens", flush=True)
        samples = write_prompts(fleet.data_dir / "big.jsonl", args.prompts, args.tokens, seed=1)
        before = used_memory(fleet, redis_server)
        seconds, _ = run(fleet, "enqueue", "--partition", "big", "--json")
        per_job = (used_memory(fleet, redis_server) - before) / args.prompts
        redis_server.client().flushall()

        # RQ's own enqueue_many, the ids in each job as the fleet's jobs carried them before.
        queue = Queue("short", connection=redis_server.client(), serializer=JSONSerializer)
        before = used_memory(fleet, redis_server)
        began = time.perf_counter()
        for start in range(0, args.compare, 1000):
            batch = [
                Queue.prepare_data(
                    JOB_FUNCTION,
                    kwargs={
                        "partition": "big",
                        "sample_id": n,
                        "input_ids": samples[n % len(samples)],
                        "sampling_params": SAMPLING,
                    },
                    job_id=job_id("big", n),
                    timeout=-1,
                )
                for n in range(start, min(start + 1000, args.compare))
            ]
            queue.enqueue_many(batch)
        inline_seconds = time.perf_counter() - began
        inline_per_job = (used_memory(fleet, redis_server) - before) / args.compare
    finally:
        redis_server.kill()
        shutil.rmtree(directory / "store", ignore_errors=True)
        (fleet.data_dir / "big.jsonl").unlink(missing_ok=True)
    return {
        "rate": args.prompts / seconds,
        "seconds": seconds,
        "per_job": per_job,
        "inline_rate": args.compare / inline_seconds,
        "inline_per_job": inline_per_job,
    }


def commit_outputs(store: LocalStore, partition: str, count: int) -> None:
    for n in range(count):
        ids = [7 + n // VOCABULARY**2 % 400, 7 + n // VOCABULARY % 400, 7 + n % 400, *range(10, 23)]
        store.commit(
            OutputRecord(
                id=n,
                partition=partition,
                job_id=job_id(partition, n),
                input_ids=ids,
                output_ids=[30, 31, 32, 2],
                text="abc",
                finish_reason={"type": "stop", "matched": 2},
                prompt_tokens=len(ids),
                completion_tokens=4,
                sampling_params=SAMPLING,
                server="http://gpu-1:30000",
                model="m",
                server_version="v",
            )
        )


def output_figures(args: argparse.Namespace, directory: Path, store_root: Path) -> dict[str, float]:
    redis_server = RedisServer(directory / "redis").start()
    redis_server.client().flushall()
    fleet = Fleet(directory, redis_server.url)
    fleet.env["FLEET_OUTPUT_DIR"] = str(store_root)
    store = LocalStore(store_root)
    figures: dict[str, float] = {}
    try:
        for name, count in (("tenth", args.outputs // 10), ("whole", args.outputs)):
            print(f"committing {count:,} outputs of {name}", flush=True)
            with open(fleet.data_dir / f"{name}.jsonl", "wb") as file:
                for n in range(count):
                    ids = [7 + n // VOCABULARY**2 % 400, 7 + n // VOCABULARY % 400, 7 + n % 400, *range(10, 23)]
                    file.write(orjson.dumps({"id": n, "input_ids": ids}) + b"\n")
            commit_outputs(store, name, count)
            # Everything is done: enqueue enqueues nothing, and sets the done counts from the store.
            run(fleet, "enqueue", "--partition", name, "--json")
            out = directory / f"export-{name}"
            figures[f"export_s_{name}"], figures[f"export_mb_{name}"] = run(
                fleet, "export", "--partition", name, "--out", str(out)
            )
            figures[f"verify_s_{name}"], figures[f"verify_mb_{name}"] = run(
                fleet, "verify", "--partition", name, "--export", str(out)
            )
            shutil.rmtree(out)
        figures["status_s"] = min(run(fleet, "status", "--json")[0] for _ in range(3))
        figures["recount_s"] = min(run(fleet, "status", "--json", "--recount")[0] for _ in range(3))
    finally:
        redis_server.kill()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--outputs", type=int, default=1_000_000)
    parser.add_argument("--compare", type=int, default=20_000, help="jobs enqueued the old way, for comparison")
    parser.add_argument("--dir", type=Path, default=None, help="where the working directory goes (default: /tmp)")
    parser.add_argument("--store", type=Path, default=Path("/dev/shm"), help="where the outputs' store goes (tmpfs)")
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="fleet-scale-", dir=args.dir))
    store_root = Path(tempfile.mkdtemp(prefix="fleet-scale-store-", dir=args.store))
    try:
        enqueued = enqueue_figures(args, directory)
        outputs = output_figures(args, directory, store_root)
    finally:
        shutil.rmtree(store_root, ignore_errors=True)
        shutil.rmtree(directory, ignore_errors=True)

    print(f"\n{args.prompts:,} prompts of {args.tokens} tokens; {args.outputs:,} outputs\n")
    rows = [
        ("enqueue, prompts/s", enqueued["rate"], enqueued["inline_rate"], "RQ enqueue_many, ids inline"),
        ("Redis memory per pending job, bytes", enqueued["per_job"], enqueued["inline_per_job"], "ids inline"),
        ("status --json, s", outputs["status_s"], outputs["recount_s"], "status --json --recount"),
        ("export peak RSS, MB", outputs["export_mb_whole"], outputs["export_mb_tenth"], "a tenth of the outputs"),
        ("verify --export peak RSS, MB", outputs["verify_mb_whole"], outputs["verify_mb_tenth"], "a tenth"),
    ]
    print(f"{'':<38}{'fleet':>12}{'alternative':>14}{'ratio':>8}  alternative")
    for label, value, other, what in rows:
        print(f"{label:<38}{value:>12,.1f}{other:>14,.1f}{value / other:>8.2f}  {what}")
    print(
        f"\nenqueue of {args.prompts:,}: {enqueued['seconds']:.0f} s; export of {args.outputs:,}: "
        f"{outputs['export_s_whole']:.0f} s; verify --export: {outputs['verify_s_whole']:.0f} s"
    )
    print(
        f"reproduce: python -m bench.scale --prompts {args.prompts} --tokens {args.tokens} --outputs {args.outputs}"
        f" --compare {args.compare}"
    )


if __name__ == "__main__":
    main()
