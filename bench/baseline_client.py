"""The kind of client the fleet replaces: one asyncio script, two semaphores, results appended to a file.

Used by bench/fleet.py as the reference for throughput and in-flight figures. It reads a JSONL of
`{"id", "queue", "input_ids", "sampling_params"}` and posts every prompt to SGLang's `/generate`.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import httpx
import orjson


async def run(prompts: Path, out: Path, url: str, short: int, long: int) -> None:
    records = [orjson.loads(line) for line in prompts.read_bytes().splitlines()]
    semaphores = {"short": asyncio.Semaphore(short), "long": asyncio.Semaphore(long)}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        with open(out, "ab") as file:

            async def one(record: dict) -> None:
                async with semaphores[record["queue"]]:
                    payload = {"input_ids": record["input_ids"], "sampling_params": record["sampling_params"]}
                    response = await client.post(f"{url}/generate", json=payload)
                    file.write(orjson.dumps({"id": record["id"], **response.json()}) + b"\n")

            await asyncio.gather(*(one(record) for record in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompts", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--url", required=True)
    parser.add_argument("--short-concurrency", type=int, default=150)
    parser.add_argument("--long-concurrency", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(run(args.prompts, args.out, args.url, args.short_concurrency, args.long_concurrency))


if __name__ == "__main__":
    main()
