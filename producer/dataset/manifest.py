"""`DIR/manifest.json` beside an export: what each file holds and what made it.

Per partition: its file, SHA-256 and counts, and the sampling parameters, servers and creation times
of its records; for the whole export: the format and the tokenizer's digest (producer/tokenizer.py),
which `verify --export` compares with the tokenizer configured now. Exporting some partitions into a
directory that holds others keeps their entries, if format and tokenizer match.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from producer.export import ExportSummary

MANIFEST = "manifest.json"


@dataclass
class Provenance:
    """What one partition's exported records were made with."""

    sampling_params: list[dict[str, Any]] = field(default_factory=list)
    servers: Counter[str] = field(default_factory=Counter)
    models: Counter[str] = field(default_factory=Counter)
    first: datetime | None = None
    last: datetime | None = None

    def add(self, sampling_params: dict[str, Any], server: str, model: str, created_at: datetime) -> None:
        """Count one record: `model` names the model and the server's version."""
        if sampling_params not in self.sampling_params:
            self.sampling_params.append(sampling_params)
        self.servers[server] += 1
        self.models[model] += 1
        self.first = created_at if self.first is None else min(self.first, created_at)
        self.last = created_at if self.last is None else max(self.last, created_at)


def write_manifest(out: Path, export_format: str, tokenizer: dict[str, str], summaries: list[ExportSummary]) -> Path:
    """Write the manifest of `summaries`, keeping the entries of other partitions exported alike before."""
    path = out / MANIFEST
    partitions: dict[str, Any] = {}
    previous = read_manifest(out)
    if previous and previous["format"] == export_format and previous["tokenizer"]["sha256"] == tokenizer["sha256"]:
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
        models.update(entry.get("models", {}))
    manifest = {
        "format": export_format,
        "exported_at": datetime.now(UTC).isoformat(),
        "tokenizer": tokenizer,
        "records": sum(entry["records"] for entry in partitions.values()),
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
        "skipped_input_ids_only": summary.skipped,
        "sampling_params": provenance.sampling_params,
        "servers": dict(sorted(provenance.servers.items())),
        "models": dict(sorted(provenance.models.items())),
        "created": {
            "first": provenance.first.isoformat() if provenance.first else None,
            "last": provenance.last.isoformat() if provenance.last else None,
        },
    }
