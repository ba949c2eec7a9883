"""`verify --export`: one exported file walked beside its partition's prompts, both in input order.

The walk holds one row at a time and a set of hashed sample IDs, so memory stays flat whatever the size of
the partition. A row is checked against the output it was made from (fidelity.py); a row out of place (a
repeat, or a sample the export should have left out) is found when a later sample's turn comes.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from common.protocol.keys import sample_key
from common.records import OutputRecord
from producer.dataset.fidelity import drift
from producer.dataset.formats import ExportOptions
from producer.dataset.report import Report
from producer.prompts import Prompt
from producer.tokenizer import ChatTokenizer

Row = tuple[int, dict[str, Any]]


class ExportCheck:
    def __init__(
        self,
        out: Path,
        partition: str,
        manifest: dict[str, Any] | None,
        tokenizer: ChatTokenizer,
        report: Report,
    ) -> None:
        self.path = out / f"{partition}.jsonl"
        self.partition = partition
        self.manifest = manifest
        self.tokenizer, self.report = tokenizer, report
        self.options = ExportOptions(manifest["format"], **manifest["options"]) if manifest else None
        self.digest = hashlib.sha256()
        self.rows = 0
        # The samples offered so far, by the hash of their ID: whether their row was read.
        self.offered: dict[int, bool] = {}
        self.repeats: Counter[str] = Counter()
        self.lacking: list[str] = []
        self._next: Row | None = None
        self._lines: Iterator[Row] = self._read() if self.path.exists() else iter(())
        if not self.path.exists():
            self._add("export", f"{self.path} does not exist")

    def offer(self, prompt: Prompt, record: OutputRecord) -> None:
        """The next accepted prompt with an output: its row comes now, unless the export leaves it out."""
        sample = sample_key(prompt.sample_id)
        self.offered[hash(sample)] = False
        while (row := self._peek()) is not None:
            found = sample_key(row[1].get("id"))
            if found == sample:
                self._take()
                self._check(row, found, record)
                return
            if hash(found) not in self.offered:
                break  # a later sample's row: this sample's is lacking
            self._take()
            self._stray(row, found)
        options = self._options()
        if options is not None and options.keeps(record) and (options.format != "sharegpt" or prompt.messages):
            self.lacking.append(sample)

    def finish(self) -> None:
        """Whatever rows are left, repeats, what is lacking, and the manifest's word on the file."""
        while (row := self._take()) is not None:
            self._stray(row, sample_key(row[1].get("id")))
        self.report.exported_rows[self.partition] += self.rows
        for sample, count in sorted(self.repeats.items()):
            self._add("export", f"{self.path.name}: id {sample!r} appears {count + 1} times")
        if self.lacking:
            shown = ", ".join(map(repr, self.lacking[:5])) + (
                f" and {len(self.lacking) - 5} more" if len(self.lacking) > 5 else ""
            )
            self._add("export", f"{self.path.name} lacks {len(self.lacking)} of its samples: {shown}")
        if self.manifest is None or not self.path.exists():
            return
        entry = self.manifest["partitions"].get(self.partition)
        if entry is None:
            self._add("export", f"{self.path.name} is not in the manifest")
            return
        if entry["records"] != self.rows:
            self._add("export", f"manifest says {entry['records']} records, {self.path.name} has {self.rows}")
        if entry["sha256"] != self.digest.hexdigest():
            self._add("export", f"{self.path.name} changed since it was exported (SHA-256 differs)")

    def _check(self, row: Row, sample: str, record: OutputRecord) -> None:
        number, fields = row
        where = f"{self.path.name}:{number} (id {sample!r})"
        self.offered[hash(sample)] = True
        options = self._options()
        assert options is not None  # a row was read
        if not options.keeps(record):
            self._add("export", f"{where} was cut at max_new_tokens, which this export leaves out")
        difference = drift(options.format, fields, record, self.tokenizer)
        if difference:
            self._add("tokens" if options.format in ("specforge", "raw") else "drift", f"{where}: {difference}")

    def _stray(self, row: Row, sample: str) -> None:
        """A row out of its place: a repeat, a row out of input order, or of no accepted prompt with an output."""
        where = f"{self.path.name}:{row[0]} (id {sample!r})"
        if self.offered.get(hash(sample)):
            self.repeats[sample] += 1
        elif hash(sample) in self.offered:
            self.offered[hash(sample)] = True
            self._add("export", f"{where} is out of input order")
        else:
            self._add("export", f"{where} is no accepted prompt with an output")

    def _options(self) -> ExportOptions | None:
        if self.options is None and (row := self._peek()) is not None:
            self.options = ExportOptions(_format_of(row[1]))
        return self.options

    def _peek(self) -> Row | None:
        if self._next is None:
            self._next = next(self._lines, None)
        return self._next

    def _take(self) -> Row | None:
        row = self._peek()
        self._next = None
        return row

    def _read(self) -> Iterator[Row]:
        with open(self.path, "rb") as file:
            for number, line in enumerate(file, 1):
                self.digest.update(line)
                if not line.strip():
                    continue
                self.rows += 1
                try:
                    yield number, orjson.loads(line)
                except orjson.JSONDecodeError as error:
                    self._add("export", f"{self.path.name}:{number} is not JSON: {error}")

    def _add(self, kind: str, detail: str) -> None:
        self.report.add(kind, self.partition, detail)


def _format_of(row: dict[str, Any]) -> str:
    """An export's format from the fields of its rows, when no manifest says it."""
    for field_name, export_format in (("loss_mask", "specforge"), ("text", "text"), ("conversations", "sharegpt")):
        if field_name in row:
            return export_format
    return "raw"
