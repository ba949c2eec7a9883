"""The rejects report, `FLEET_OUTPUT_DIR/rejects/<partition>.jsonl`: the records enqueue refused, and why.

Enqueue writes it after each partition; the dataset commands read it to know which prompts were accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import orjson

from common.settings import Settings
from producer.partitions import Partition
from producer.prompts import Prompt, Reject, read_prompts


def report_path(settings: Settings, partition: str) -> Path:
    return settings.rejects_dir / f"{partition}.jsonl"


def write_rejects(settings: Settings, partition: str, rejects: list[Reject]) -> None:
    path = report_path(settings, partition)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(asdict(reject)) + b"\n" for reject in rejects))


def rejected_lines(settings: Settings, partition: str) -> set[int]:
    """The lines the producer refused for `partition`."""
    path = report_path(settings, partition)
    if not path.exists():
        return set()
    return {orjson.loads(line)["line"] for line in path.read_bytes().splitlines() if line}


def accepted_prompts(settings: Settings, partition: Partition) -> Iterator[Prompt]:
    """The partition's prompts that the producer accepted, in input order, read as they are needed."""
    refused = rejected_lines(settings, partition.name)
    for item in read_prompts(partition.path):
        if isinstance(item, Prompt) and item.line not in refused:
            yield item
