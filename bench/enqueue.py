"""(f) Enqueue rate for 100,000 prompts, without tokenization, beside RQ's own `enqueue_many`.

The producer runs as a user runs it (`python -m producer enqueue`) on a partition of pre-tokenized
`input_ids` records, so the chat template costs nothing and what is measured is reading, checking
and enqueueing. It is then run again: every prompt is already queued, so nothing is enqueued. The
reference is RQ's `Queue.enqueue_many` for the same number of jobs with the same arguments, which
is neither idempotent nor safe against two producers at once.

    python -m bench.enqueue [--prompts 100000]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from rq import Queue
from rq.serializers import JSONSerializer

from common.protocol.keys import JOB_FUNCTION, job_id
from tests.harness import Fleet, RedisServer

PROMPT_TOKENS = 300


def timed(action: callable) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100_000)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="fleet-enqueue-"))
    redis_server = RedisServer(directory).start()
    fleet = Fleet(directory, redis_server.url)
    rng = random.Random(1)
    records = [
        {"id": n, "input_ids": [rng.randrange(10, 400) for _ in range(PROMPT_TOKENS)]} for n in range(args.prompts)
    ]
    try:
        fleet.write_partition("p", records)
        first = timed(lambda: fleet.producer("enqueue"))
        again = timed(lambda: fleet.producer("enqueue"))
        queued = redis_server.client().llen("rq:queue:short")

        sampling_params = {"max_new_tokens": 10240, "temperature": 0.6, "skip_special_tokens": False}
        queue = Queue("reference", connection=redis_server.client(), serializer=JSONSerializer)

        def enqueue_many() -> None:
            for start in range(0, args.prompts, 1000):
                batch = records[start : start + 1000]
                queue.enqueue_many(
                    [
                        Queue.prepare_data(
                            JOB_FUNCTION,
                            kwargs={
                                "partition": "p",
                                "sample_id": record["id"],
                                "input_ids": record["input_ids"],
                                "sampling_params": sampling_params,
                            },
                            job_id=job_id("reference", record["id"]),
                            timeout=-1,
                        )
                        for record in batch
                    ]
                )

        reference = timed(enqueue_many)
    finally:
        redis_server.kill()

    print(f"\n{args.prompts} prompts of {PROMPT_TOKENS} tokens, {queued} queued\n")
    print(f"{'':<46}{'seconds':>10}{'prompts/s':>12}")
    print(f"{'python -m producer enqueue (first run)':<46}{first:>10.1f}{args.prompts / first:>12.0f}")
    print(f"{'python -m producer enqueue (again: nothing to do)':<46}{again:>10.1f}{args.prompts / again:>12.0f}")
    print(f"{'RQ Queue.enqueue_many, in process':<46}{reference:>10.1f}{args.prompts / reference:>12.0f}")
    print(f"\nfirst run / enqueue_many time: {first / reference:.2f}x (the producer's time includes its start-up)")
    print(f"reproduce: python -m bench.enqueue --prompts {args.prompts}")


if __name__ == "__main__":
    main()
