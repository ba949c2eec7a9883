"""`verify`: whether the output store holds exactly the dataset the partitions call for, made as configured now.

Problems (verify exits 1):
- an accepted prompt without its output, or an output of no accepted prompt (a stale or foreign file);
- a file whose record is not what its name and place say (job ID, partition, sample, shard), or that
  is no record at all; a sample held by two files (the store's hard-link commit makes one file per
  name, so a second one can only come from outside it);
- a record whose input_ids differ from what the tokenizer and chat template make of its prompt now
  (a template or tokenizer changed mid-run);
- a partition whose outputs were made under different sampling parameters or by different models;
- with `--export DIR`, an export that repeats an id, holds one of no accepted prompt or one its options
  leave out, lacks one, or disagrees with its manifest (counts, file digest, tokenizer); a `specforge` or
  `raw` row whose tokens are not exactly the prompt's ids and the generated ids (fidelity.py).
Notes (reported, not failing): outputs cut at max_new_tokens; partitions made by several servers, which a
fleet of servers does by design; `text` and `sharegpt` rows that a trainer, tokenizing them again with the
model's tokenizer and template, would train on other tokens than the generated ones.

Each partition is read in input order, a prompt and its output at a time, with its export beside it
(export_check.py), then the store's listing is checked for what no prompt explains: memory holds hashes of
the sample IDs, not the samples.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import orjson
from pydantic import ValidationError
from tqdm import tqdm

from common.protocol.keys import job_id, sample_key
from common.records import OutputRecord
from common.settings import Settings
from common.store import OutputStore
from common.store.base import job_id_of
from producer.dataset.export_check import ExportCheck
from producer.dataset.manifest import read_manifest
from producer.dataset.outputs import read_output
from producer.dataset.report import Report
from producer.partitions import Partition
from producer.prompts import Prompt, Rejected
from producer.rejects import accepted_prompts
from producer.tokenizer import ChatTokenizer


class Verifier:
    def __init__(
        self, settings: Settings, store: OutputStore, tokenizer: ChatTokenizer, export: Path | None, show: int = 20
    ) -> None:
        self.settings = settings
        self.store = store
        self.tokenizer = tokenizer
        self.report = Report(keep=show)
        self.export = export
        self.manifest = read_manifest(export) if export is not None else None
        if export is not None:
            if self.manifest is None:
                self.report.add("export", "", f"{export}: no manifest.json")
            elif self.manifest["tokenizer"]["sha256"] != tokenizer.digest():
                self.report.add(
                    "export", "", f"{export}: exported with another tokenizer than {tokenizer.name} as it is now"
                )

    def partition(self, partition: Partition) -> None:
        """Check one partition's outputs, and its export if asked, against its accepted prompts."""
        name = partition.name
        export = None
        if self.export is not None:
            export = ExportCheck(self.export, name, self.manifest, self.tokenizer, self.report)
        # Hashes of the accepted prompts' job IDs, and of their samples' IDs before versions, 8 bytes each: the
        # store's listing is checked against them.
        expected, samples = array("q"), array("q")
        sampling_params = partition.sampling_params(self.settings)
        sampling: Counter[bytes] = Counter()
        servers: Counter[str] = Counter()
        models: Counter[str] = Counter()
        for prompt in tqdm(
            accepted_prompts(self.store, partition), desc=f"verify {name}", unit=" prompts", disable=None, leave=False
        ):
            identifier, data = read_output(self.store, name, prompt, sampling_params)
            expected.append(hash(identifier))
            samples.append(hash(job_id(name, prompt.sample_id)))
            key = self.store.sample_key(name, identifier)
            record = self._parse(name, key, data, prompt)
            if record is None or not self._filed_right(name, key, record):
                continue
            self._check_input_ids(name, prompt, record)
            sampling[orjson.dumps(record.sampling_params, option=orjson.OPT_SORT_KEYS)] += 1
            servers[record.server] += 1
            models[record.model] += 1
            if record.finish_reason.get("type") == "length":
                self.report.add("length", name, f"{record.id!r} ({record.completion_tokens} tokens)")
            if export is not None:
                export.offer(prompt, record)
        if export is not None:
            export.finish()
            export = None  # its memory goes before the listing's
        self._unexplained(name, expected, samples)
        if len(sampling) > 1:
            shown = "; ".join(f"{count} made with {params.decode()}" for params, count in sampling.most_common())
            self.report.add("sampling", name, shown)
        if len(models) > 1:
            shown = ", ".join(f"{model or 'unnamed'} ({count})" for model, count in models.most_common())
            self.report.add("models", name, shown)
        if len(servers) > 1:
            self.report.add("servers", name, ", ".join(f"{url} ({count})" for url, count in servers.most_common()))

    def foreign(self, name: str) -> None:
        """A store partition with no partition file: every output in it is unexpected."""
        for key in self.store.sample_keys(name):
            self.report.outputs += 1
            self.report.add("unexpected", name, f"{self._where(key)}: no {name}.jsonl in {self.settings.data_dir}")

    def _unexplained(self, name: str, hashes: array, samples: array) -> None:
        """Records in the store that no accepted prompt explains: earlier versions, foreign, misfiled or copies."""
        expected, accepted = _members(hashes), _members(samples)
        for key in self.store.sample_keys(name):
            identifier = job_id_of(key)
            if expected(identifier) and key == self.store.sample_key(name, identifier):
                continue
            record = self._parse(name, key, self.store.read(key))
            if record is None:
                continue
            if self._filed_right(name, key, record):
                if record.partition == name and accepted(job_id(name, record.id)):
                    self.report.add(
                        "stale", name, f"{self._where(key)}: sample {record.id!r}, version {record.version}"
                    )
                else:
                    self.report.add(
                        "unexpected", name, f"{self._where(key)}: sample {record.id!r} is no accepted prompt"
                    )
                continue
            own = job_id(name, record.id, record.version)
            if record.partition == name and expected(own) and self.store.has(name, own):
                copies = f"{self._where(self.store.sample_key(name, own))}, {self._where(key)}"
                self.report.add("duplicate", name, f"{name}/{sample_key(record.id)} is in 2 files: {copies}")

    def _parse(
        self, partition: str, key: str, data: bytes | None, missing: Prompt | None = None
    ) -> OutputRecord | None:
        """The record at `key`, or None, with what is wrong with it reported."""
        if data is None:
            if missing is not None:
                self.report.add("missing", partition, f"{missing.sample_id!r} (line {missing.line})")
            return None
        self.report.outputs += 1
        try:
            return OutputRecord.from_json(data)
        except (ValidationError, orjson.JSONDecodeError) as error:
            self.report.add("unreadable", partition, f"{self._where(key)}: {str(error).splitlines()[0]}")
            return None

    def _filed_right(self, partition: str, key: str, record: OutputRecord) -> bool:
        name = job_id_of(key)
        expected = job_id(record.partition, record.id, record.version)
        if record.partition != partition or record.job_id != name or expected != name:
            held = f"{record.partition}/{record.id!r} (job {record.job_id})"
            self.report.add(
                "misfiled", partition, f"{self._where(key)}: holds {held}, which belongs in {expected}.json"
            )
            return False
        proper = self.store.sample_key(partition, name)
        if key != proper:
            self.report.add(
                "misfiled", partition, f"{self._where(key)}: in the wrong shard, not at {self._where(proper)}"
            )
            return False
        return True

    def _where(self, key: str) -> str:
        return f"{self.store.location}/{key}"

    def _check_input_ids(self, partition: str, prompt: Prompt, record: OutputRecord) -> None:
        try:
            now = self.tokenizer.encode(prompt)
        except Rejected as error:
            self.report.add("input_ids", partition, f"{record.id!r}: the prompt no longer encodes: {error}")
            return
        if now != record.input_ids:
            first = next((i for i, (a, b) in enumerate(zip(now, record.input_ids, strict=False)) if a != b), None)
            where = f"first difference at token {first}" if first is not None else "one is a prefix of the other"
            self.report.add(
                "input_ids", partition, f"{record.id!r}: {len(record.input_ids)} tokens then, {len(now)} now; {where}"
            )


def _members(hashes: array) -> Callable[[str], bool]:
    """Whether an ID's hash is among `hashes`, searched sorted: 8 bytes an ID rather than a set's 60."""
    ordered = array("q", sorted(hashes))

    def member(identifier: str) -> bool:
        index = bisect_left(ordered, hash(identifier))
        return index < len(ordered) and ordered[index] == hash(identifier)

    return member
