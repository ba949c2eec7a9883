"""Writing the dataset: one row per committed sample, per partition, in input order (formats.py).

Each partition's prompts are read one at a time beside their outputs, so memory stays flat whatever the
partition's size; the file is written under a temporary name and renamed when whole.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import orjson
from tqdm import tqdm

from common.records import OutputRecord
from common.settings import Settings
from common.store import OutputStore
from producer.dataset.fidelity import drift
from producer.dataset.formats import ExportOptions, is_truncated
from producer.dataset.manifest import ExportSummary
from producer.dataset.outputs import read_output
from producer.partitions import Partition
from producer.rejects import accepted_prompts, rejected_lines
from producer.tokenizer import ChatTokenizer


def export_partition(
    settings: Settings,
    store: OutputStore,
    partition: Partition,
    out: Path,
    options: ExportOptions,
    tokenizer: ChatTokenizer,
) -> ExportSummary:
    """Write `out/<partition>.jsonl` in the options' format."""
    summary = ExportSummary(partition.name, out / f"{partition.name}.jsonl")
    summary.rejected = len(rejected_lines(store, partition.name))
    digest = hashlib.sha256()
    temporary = summary.path.with_suffix(".jsonl.tmp")
    prompts = accepted_prompts(store, partition)
    sampling_params = partition.sampling_params(settings)
    with open(temporary, "wb") as file:
        for prompt in tqdm(prompts, desc=partition.name, unit=" records", disable=None, leave=False):
            _, data = read_output(store, partition.name, prompt, sampling_params)
            if data is None:
                summary.missing.append(prompt.sample_id)
                continue
            record = OutputRecord.from_json(data)
            summary.truncated += is_truncated(record)
            if not options.keeps(record):
                continue
            row = options.row(prompt, record, tokenizer)
            if row is None:
                summary.skipped += 1
                continue
            if options.format == "text" and drift("text", row, record, tokenizer):
                summary.drifted += 1
            line = orjson.dumps(row) + b"\n"
            file.write(line)
            digest.update(line)
            summary.exported += 1
            summary.longest = max(summary.longest, len(record.input_ids) + len(record.output_ids))
            summary.provenance.add(record)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, summary.path)
    summary.sha256 = digest.hexdigest()
    return summary
