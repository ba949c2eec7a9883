"""`verify`: whether the output store holds exactly the dataset the partitions call for, made as configured now.

Problems (verify exits 1):
- an accepted prompt without its output, or an output of no accepted prompt (a stale or foreign file);
- a file whose record is not what its name and place say (job ID, partition, sample, shard), or that
  is no record at all; a sample held by two files (the store's hard-link commit makes one file per
  name, so a second one can only come from outside it);
- a record whose input_ids differ from what the tokenizer and chat template make of its prompt now
  (a template or tokenizer changed mid-run);
- a partition whose outputs were made under different sampling parameters or by different models;
- with `--export DIR`, an export that repeats an id, holds one of no accepted prompt, lacks one, or
  disagrees with its manifest (counts, file digest, tokenizer).
Notes (reported, not failing): outputs cut at max_new_tokens, and partitions made by several servers,
which a fleet of servers does by design.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from pydantic import ValidationError
from tqdm import tqdm

from common.keys import job_id, sample_key
from common.records import OutputRecord
from common.settings import Settings
from common.store import OutputStore
from producer.export import accepted_prompts
from producer.manifest import read_manifest
from producer.partitions import Partition
from producer.prompts import Prompt, Rejected
from producer.tokenizer import ChatTokenizer

PROBLEMS = {
    "missing": "accepted prompts without an output",
    "unexpected": "outputs of no accepted prompt (stale or foreign files)",
    "misfiled": "files whose record is not what their name and place say",
    "unreadable": "files that are not output records",
    "duplicate": "samples held by more than one file",
    "input_ids": "outputs whose input_ids differ from what the tokenizer and template make now",
    "sampling": "partitions mixing sampling parameters",
    "models": "partitions mixing outputs of different models",
    "export": "export problems",
}
NOTES = {
    "length": "outputs cut at max_new_tokens (finish_reason length)",
    "servers": "partitions made by more than one server",
}


@dataclass
class Finding:
    kind: str
    partition: str
    detail: str


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    outputs: int = 0

    def add(self, kind: str, partition: str, detail: str) -> None:
        self.findings.append(Finding(kind, partition, detail))

    @property
    def problems(self) -> list[Finding]:
        return [finding for finding in self.findings if finding.kind in PROBLEMS]


class Verifier:
    def __init__(self, settings: Settings, store: OutputStore, tokenizer: ChatTokenizer) -> None:
        self.settings = settings
        self.store = store
        self.tokenizer = tokenizer
        self.report = Report()

    def partition(self, partition: Partition) -> None:
        """Check the store's outputs of one partition against its accepted prompts."""
        name = partition.name
        expected = {job_id(name, prompt.sample_id): prompt for prompt in accepted_prompts(self.settings, partition)}
        holders: defaultdict[tuple[str, str], list[Path]] = defaultdict(list)
        found: set[str] = set()
        sampling: Counter[bytes] = Counter()
        servers: Counter[str] = Counter()
        models: Counter[str] = Counter()
        for path in tqdm(
            sorted(self.store.files(name)), desc=f"verify {name}", unit=" outputs", disable=None, leave=False
        ):
            record = self._read(name, path)
            if record is None:
                continue
            holders[(record.partition, sample_key(record.id))].append(path)
            if not self._filed_right(name, path, record):
                continue
            prompt = expected.get(record.job_id)
            if prompt is None:
                self.report.add("unexpected", name, f"{path.name}: sample {record.id!r} is no accepted prompt")
                continue
            found.add(record.job_id)
            self._check_input_ids(name, prompt, record)
            sampling[orjson.dumps(record.sampling_params, option=orjson.OPT_SORT_KEYS)] += 1
            servers[record.server] += 1
            models[record.model] += 1
            if record.finish_reason.get("type") == "length":
                self.report.add("length", name, f"{record.id!r} ({record.completion_tokens} tokens)")
        for (partition_name, sample), paths in holders.items():
            if len(paths) > 1:
                files = ", ".join(sorted(str(path) for path in paths))
                self.report.add("duplicate", name, f"{partition_name}/{sample} is in {len(paths)} files: {files}")
        for identifier, prompt in expected.items():
            if identifier not in found:
                self.report.add("missing", name, f"{prompt.sample_id!r} (line {prompt.line})")
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
        for path in sorted(self.store.files(name)):
            self.report.outputs += 1
            self.report.add("unexpected", name, f"{path}: no {name}.jsonl in {self.settings.data_dir}")

    def export(self, out: Path, partitions: list[Partition]) -> None:
        """Check `out/<partition>.jsonl` of each partition against its accepted prompts and the manifest."""
        manifest = read_manifest(out)
        if manifest is None:
            self.report.add("export", "", f"{out}: no manifest.json")
            entries = {}
        else:
            entries = manifest["partitions"]
            if manifest["tokenizer"]["sha256"] != self.tokenizer.digest():
                self.report.add(
                    "export", "", f"{out}: exported with another tokenizer than {self.tokenizer.name} as it is now"
                )
        for partition in partitions:
            self._export_file(out, partition, entries.get(partition.name), manifest)

    def _export_file(self, out: Path, partition: Partition, entry: dict | None, manifest: dict | None) -> None:
        name = partition.name
        path = out / f"{name}.jsonl"
        if not path.exists():
            self.report.add("export", name, f"{path} does not exist")
            return
        data = path.read_bytes()
        ids = Counter(sample_key(orjson.loads(line)["id"]) for line in data.splitlines() if line.strip())
        prompts = accepted_prompts(self.settings, partition)
        accepted = {sample_key(prompt.sample_id) for prompt in prompts}
        if manifest is not None and manifest["format"] == "sharegpt":
            # ShareGPT cannot show input_ids-only prompts: the export leaves them out.
            accepted -= {sample_key(prompt.sample_id) for prompt in prompts if prompt.messages is None}
        for sample, count in sorted(ids.items()):
            if count > 1:
                self.report.add("export", name, f"{path.name}: id {sample!r} appears {count} times")
            if sample not in accepted:
                self.report.add("export", name, f"{path.name}: id {sample!r} is no accepted prompt")
        if lacking := accepted - set(ids):
            self.report.add("export", name, f"{path.name} lacks {len(lacking)} accepted prompts: {_some(lacking)}")
        if manifest is None:
            return
        if entry is None:
            self.report.add("export", name, f"{path.name} is not in the manifest")
            return
        if entry["records"] != sum(ids.values()):
            self.report.add(
                "export", name, f"manifest says {entry['records']} records, {path.name} has {sum(ids.values())}"
            )
        if entry["sha256"] != hashlib.sha256(data).hexdigest():
            self.report.add("export", name, f"{path.name} changed since it was exported (SHA-256 differs)")

    def _read(self, partition: str, path: Path) -> OutputRecord | None:
        self.report.outputs += 1
        try:
            return OutputRecord.from_json(path.read_bytes())
        except (ValidationError, orjson.JSONDecodeError) as error:
            self.report.add("unreadable", partition, f"{path}: {str(error).splitlines()[0]}")
            return None

    def _filed_right(self, partition: str, path: Path, record: OutputRecord) -> bool:
        name = path.stem
        expected = job_id(record.partition, record.id)
        if record.partition != partition or record.job_id != name or expected != name:
            held = f"{record.partition}/{record.id!r} (job {record.job_id})"
            self.report.add("misfiled", partition, f"{path}: holds {held}, which belongs in {expected}.json")
            return False
        if path != self.store.path(partition, name):
            self.report.add(
                "misfiled", partition, f"{path}: in the wrong shard, not at {self.store.path(partition, name)}"
            )
            return False
        return True

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


def render(report: Report, partitions: int, show: int) -> str:
    lines = []
    for heading, kinds in (("PROBLEMS", PROBLEMS), ("notes", NOTES)):
        groups = [(kind, [finding for finding in report.findings if finding.kind == kind]) for kind in kinds]
        groups = [(kind, findings) for kind, findings in groups if findings]
        if not groups:
            continue
        lines.append(heading)
        for kind, findings in groups:
            lines.append(f"  {kinds[kind]} ({len(findings)}):")
            for finding in findings[:show]:
                lines.append(f"    {finding.partition + ': ' if finding.partition else ''}{finding.detail}")
            if len(findings) > show:
                lines.append(f"    ... and {len(findings) - show} more")
    count = len(report.problems)
    summary = f"{report.outputs} outputs of {partitions} partitions"
    lines.append(f"verify: {count} problems in {summary}" if count else f"verify: all good, {summary}")
    return "\n".join(lines)


def _some(values: set[str], shown: int = 5) -> str:
    listed = ", ".join(repr(value) for value in sorted(values)[:shown])
    return listed + (f" and {len(values) - shown} more" if len(values) > shown else "")
