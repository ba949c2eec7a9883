"""The rejects report, `rejects/<partition>.jsonl` in the output store: the records enqueue refused, and why.

Enqueue writes it after each partition; the dataset commands read it to know which prompts were accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

import orjson

from common.store import OutputStore
from common.store.base import REJECTS
from producer.partitions import Partition
from producer.prompts import Prompt, Reject, read_prompts


def report_key(partition: str) -> str:
    return f"{REJECTS}/{partition}.jsonl"


def write_rejects(store: OutputStore, partition: str, rejects: list[Reject]) -> None:
    store.replace(report_key(partition), b"".join(orjson.dumps(asdict(reject)) + b"\n" for reject in rejects))


def rejected_lines(store: OutputStore, partition: str) -> set[int]:
    """The lines the producer refused for `partition`."""
    report = store.read(report_key(partition)) or b""
    return {orjson.loads(line)["line"] for line in report.splitlines() if line}


def accepted_prompts(store: OutputStore, partition: Partition) -> Iterator[Prompt]:
    """The partition's prompts that the producer accepted, in input order, read as they are needed.

    The rejects report lists every line enqueue refused, duplicate ids included, so they are not looked for again.
    """
    refused = rejected_lines(store, partition.name)
    for item in read_prompts(partition.path, find_duplicates=False):
        if isinstance(item, Prompt) and item.line not in refused:
            yield item
