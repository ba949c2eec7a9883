"""Writing the dataset: one record per completed sample, per partition, in input order.

Two formats: `raw`, every field of each committed record as the worker wrote it, token IDs
included; and `sharegpt`, the conversations SpecForge trains on (producer/sharegpt.py).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import orjson
from tqdm import tqdm

from common.keys import job_id
from common.records import OutputRecord
from common.settings import Settings
from common.store import OutputStore
from producer.manifest import Provenance
from producer.partitions import Partition
from producer.prompts import Prompt, read_prompts
from producer.sharegpt import AssistantFormat, sharegpt_record


@dataclass
class ExportSummary:
    partition: str
    path: Path
    exported: int = 0
    rejected: int = 0
    missing: list[str | int] = field(default_factory=list)
    # Prompts given as input_ids only: ShareGPT has no turns to show them as.
    skipped: int = 0
    sha256: str = ""
    provenance: Provenance = field(default_factory=Provenance)


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


def export_partition(
    settings: Settings, store: OutputStore, partition: Partition, out: Path, sharegpt: AssistantFormat | None = None
) -> ExportSummary:
    """Write `out/<partition>.jsonl`, raw or, given the model's assistant format, as ShareGPT."""
    summary = ExportSummary(partition.name, out / f"{partition.name}.jsonl")
    prompts = accepted_prompts(settings, partition)
    summary.rejected = len(rejected_lines(settings, partition.name))
    out.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    temporary = summary.path.with_suffix(".jsonl.tmp")
    with open(temporary, "wb") as file:
        for prompt in tqdm(prompts, desc=partition.name, unit=" records", disable=None, leave=False):
            path = store.path(partition.name, job_id(partition.name, prompt.sample_id))
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                summary.missing.append(prompt.sample_id)
                continue
            if sharegpt is None:
                fields = orjson.loads(data)
                created_at = datetime.fromisoformat(fields["created_at"])
                model = f"{fields.get('model', '')} (SGLang {fields.get('server_version', '')})"
                summary.provenance.add(fields["sampling_params"], fields["server"], model, created_at)
            else:
                record = OutputRecord.from_json(data)
                conversation = sharegpt_record(prompt, record, sharegpt)
                if conversation is None:
                    summary.skipped += 1
                    continue
                model = f"{record.model} (SGLang {record.server_version})"
                summary.provenance.add(record.sampling_params, record.server, model, record.created_at)
                data = orjson.dumps(conversation)
            line = data + b"\n"
            file.write(line)
            digest.update(line)
            summary.exported += 1
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, summary.path)
    summary.sha256 = digest.hexdigest()
    return summary
