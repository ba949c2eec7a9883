"""`DIR/manifest.json` beside an export: what each file holds and what made it.

Per partition: its file, SHA-256 and counts (records, missing, rejected, truncated, left out), the longest
record in tokens, and the sampling parameters, servers, models and creation times of its records; for the
whole export: the format and its options, and the tokenizer's digest (producer/tokenizer.py), which
`verify --export` compares with the tokenizer configured now. Exporting some partitions into a directory
that holds others keeps their entries, if format, options and tokenizer match.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from common.records import OutputRecord
from producer.dataset.formats import ExportOptions

MANIFEST = "manifest.json"


@dataclass
class Provenance:
    """What one partition's exported records were made with."""

    sampling_params: list[dict[str, Any]] = field(default_factory=list)
    servers: Counter[str] = field(default_factory=Counter)
    models: Counter[str] = field(default_factory=Counter)
    first: datetime | None = None
    last: datetime | None = None

    def add(self, record: OutputRecord) -> None:
        if record.sampling_params not in self.sampling_params:
            self.sampling_params.append(record.sampling_params)
        self.servers[record.server] += 1
        self.models[f"{record.model} (SGLang {record.server_version})"] += 1
        self.first = record.created_at if self.first is None else min(self.first, record.created_at)
        self.last = record.created_at if self.last is None else max(self.last, record.created_at)


@dataclass
class ExportSummary:
    """One partition's export: where it went and what it holds or left out."""

    partition: str
    path: Path
    exported: int = 0
    rejected: int = 0
    missing: list[str | int] = field(default_factory=list)
    # Generations cut at max_new_tokens: left out unless the options keep them.
    truncated: int = 0
    # Prompts given as input_ids only: ShareGPT has no turns to show them as.
    skipped: int = 0
    # `text` records that do not tokenize back into the generated ids.
    drifted: int = 0
    # The longest record in tokens, prompt and generation: a trainer's max_length below it cuts records.
    longest: int = 0
    sha256: str = ""
    provenance: Provenance = field(default_factory=Provenance)


def write_manifest(
    out: Path, options: ExportOptions, tokenizer: dict[str, str], summaries: list[ExportSummary]
) -> Path:
    """Write the manifest of `summaries`, keeping the entries of other partitions exported alike before."""
    path = out / MANIFEST
    partitions: dict[str, Any] = {}
    previous = read_manifest(out)
    if (
        previous
        and previous["format"] == options.format
        and previous.get("options") == options.to_json()
        and previous["tokenizer"]["sha256"] == tokenizer["sha256"]
    ):
        partitions = {name: entry for name, entry in previous["partitions"].items() if (out / entry["file"]).exists()}
    for summary in summaries:
        partitions[summary.partition] = _entry(summary)
    partitions = dict(sorted(partitions.items()))
    firsts = [entry["created"]["first"] for entry in partitions.values() if entry["created"]["first"]]
    lasts = [entry["created"]["last"] for entry in partitions.values() if entry["created"]["last"]]
    servers: Counter[str] = Counter()
    models: Counter[str] = Counter()
    for entry in partitions.values():
        servers.update(entry["servers"])
        models.update(entry["models"])
    manifest = {
        "format": options.format,
        "options": options.to_json(),
        "exported_at": datetime.now(UTC).isoformat(),
        "tokenizer": tokenizer,
        "records": sum(entry["records"] for entry in partitions.values()),
        "longest_tokens": max((entry["longest_tokens"] for entry in partitions.values()), default=0),
        "partitions": partitions,
        "servers": dict(sorted(servers.items())),
        "models": dict(sorted(models.items())),
        "created": {
            "first": min(firsts, key=datetime.fromisoformat) if firsts else None,
            "last": max(lasts, key=datetime.fromisoformat) if lasts else None,
        },
    }
    temporary = path.with_suffix(".json.tmp")
    temporary.write_bytes(orjson.dumps(manifest, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(temporary, path)
    return path


def read_manifest(out: Path) -> dict[str, Any] | None:
    try:
        return orjson.loads((out / MANIFEST).read_bytes())
    except FileNotFoundError:
        return None


def _entry(summary: ExportSummary) -> dict[str, Any]:
    provenance = summary.provenance
    return {
        "file": summary.path.name,
        "sha256": summary.sha256,
        "records": summary.exported,
        "missing": len(summary.missing),
        "rejected": summary.rejected,
        "truncated": summary.truncated,
        "skipped_input_ids_only": summary.skipped,
        "text_not_reencoding": summary.drifted,
        "longest_tokens": summary.longest,
        "sampling_params": provenance.sampling_params,
        "servers": dict(sorted(provenance.servers.items())),
        "models": dict(sorted(provenance.models.items())),
        "created": {
            "first": provenance.first.isoformat() if provenance.first else None,
            "last": provenance.last.isoformat() if provenance.last else None,
        },
    }
