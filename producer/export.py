"""Writing the dataset: one record per completed sample, per partition, in input order."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from common.keys import job_id
from common.settings import Settings
from common.store import OutputStore
from producer.partitions import Partition
from producer.prompts import Prompt, read_prompts


@dataclass
class ExportSummary:
    partition: str
    path: Path
    exported: int = 0
    rejected: int = 0
    missing: list[str | int] = field(default_factory=list)


def rejected_lines(settings: Settings, partition: str) -> set[int]:
    """The lines the producer refused for `partition`, from its rejects report."""
    report = settings.rejects_dir / f"{partition}.jsonl"
    if not report.exists():
        return set()
    return {orjson.loads(line)["line"] for line in report.read_bytes().splitlines() if line}


def accepted_prompts(settings: Settings, partition: Partition) -> list[Prompt]:
    """The partition's prompts that the producer accepted, in input order."""
    refused = rejected_lines(settings, partition.name)
    return [item for item in read_prompts(partition.path) if isinstance(item, Prompt) and item.line not in refused]


def export_partition(settings: Settings, store: OutputStore, partition: Partition, out: Path) -> ExportSummary:
    summary = ExportSummary(partition.name, out / f"{partition.name}.jsonl")
    prompts = accepted_prompts(settings, partition)
    summary.rejected = len(rejected_lines(settings, partition.name))
    out.mkdir(parents=True, exist_ok=True)
    temporary = summary.path.with_suffix(".jsonl.tmp")
    with open(temporary, "wb") as file:
        for prompt in prompts:
            path = store.path(partition.name, job_id(partition.name, prompt.sample_id))
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                summary.missing.append(prompt.sample_id)
                continue
            file.write(data + b"\n")
            summary.exported += 1
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, summary.path)
    return summary
