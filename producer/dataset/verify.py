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
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from pydantic import ValidationError
from tqdm import tqdm

from common.protocol.keys import job_id, sample_key
from common.records import OutputRecord
from common.settings import Settings
from common.store import OutputStore
from producer.dataset.fidelity import drift
from producer.dataset.formats import ExportOptions, is_truncated
from producer.dataset.manifest import read_manifest
from producer.partitions import Partition
from producer.prompts import Prompt, Rejected
from producer.rejects import accepted_prompts
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
    "tokens": "exported rows whose tokens are not exactly the prompt's and the generated ones",
}
NOTES = {
    "length": "outputs cut at max_new_tokens (finish_reason length)",
    "servers": "partitions made by more than one server",
    "drift": "exported rows a trainer would tokenize into other tokens than the generated ones"
    " (--format specforge keeps them exact)",
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
    # Rows read per exported partition: what the drift notes are counted against.
    exported_rows: Counter[str] = field(default_factory=Counter)

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
        # Per partition, each sample with an output: whether it was cut short and whether its prompt has turns.
        self._outputs: dict[str, dict[str, tuple[bool, bool]]] = {}

    def partition(self, partition: Partition) -> None:
        """Check the store's outputs of one partition against its accepted prompts."""
        name = partition.name
        expected = {job_id(name, prompt.sample_id): prompt for prompt in accepted_prompts(self.settings, partition)}
        holders: defaultdict[tuple[str, str], list[Path]] = defaultdict(list)
        found: set[str] = set()
        outputs = self._outputs[name] = {}
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
            outputs[sample_key(record.id)] = (is_truncated(record), prompt.messages is not None)
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
        """Check `out/<partition>.jsonl` of each partition (already checked by `partition`) against its outputs."""
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
            self._export_file(out, partition.name, manifest, entries.get(partition.name))

    def _export_file(self, out: Path, name: str, manifest: dict | None, entry: dict | None) -> None:
        path = out / f"{name}.jsonl"
        if not path.exists():
            self.report.add("export", name, f"{path} does not exist")
            return
        options = ExportOptions(manifest["format"], **manifest["options"]) if manifest else None
        outputs = self._outputs.get(name, {})
        digest = hashlib.sha256()
        ids: Counter[str] = Counter()
        with open(path, "rb") as file:
            for number, line in enumerate(file, 1):
                digest.update(line)
                if not line.strip():
                    continue
                try:
                    row = orjson.loads(line)
                except orjson.JSONDecodeError as error:
                    self.report.add("export", name, f"{path.name}:{number} is not JSON: {error}")
                    continue
                options = options or ExportOptions(_format_of(row))
                sample = sample_key(row.get("id"))
                ids[sample] += 1
                if ids[sample] == 1:
                    self._export_row(
                        f"{path.name}:{number} (id {sample!r})", name, sample, row, options, sample in outputs
                    )
        self.report.exported_rows[name] += sum(ids.values())
        for sample, count in sorted(ids.items()):
            if count > 1:
                self.report.add("export", name, f"{path.name}: id {sample!r} appears {count} times")
        if options is not None:
            wanted = {
                sample
                for sample, (truncated, has_turns) in outputs.items()
                if (options.keeps_truncated or not truncated) and (has_turns or options.format != "sharegpt")
            }
            if lacking := wanted - set(ids):
                self.report.add("export", name, f"{path.name} lacks {len(lacking)} of its samples: {_some(lacking)}")
        if manifest is None:
            return
        if entry is None:
            self.report.add("export", name, f"{path.name} is not in the manifest")
            return
        if entry["records"] != sum(ids.values()):
            self.report.add(
                "export", name, f"manifest says {entry['records']} records, {path.name} has {sum(ids.values())}"
            )
        if entry["sha256"] != digest.hexdigest():
            self.report.add("export", name, f"{path.name} changed since it was exported (SHA-256 differs)")

    def _export_row(
        self, where: str, name: str, sample: str, row: dict, options: ExportOptions, has_output: bool
    ) -> None:
        """One exported row against the output it was made from."""
        record = self.store.load(name, job_id(name, sample)) if has_output else None
        if record is None:
            self.report.add("export", name, f"{where} is no accepted prompt with an output")
            return
        if not options.keeps(record):
            self.report.add("export", name, f"{where} was cut at max_new_tokens, which this export leaves out")
        difference = drift(options.format, row, record, self.tokenizer)
        if difference:
            kind = "tokens" if options.format in ("specforge", "raw") else "drift"
            self.report.add(kind, name, f"{where}: {difference}")

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
            if kind in ("drift", "tokens"):
                per_partition = Counter(finding.partition for finding in findings)
                lines += [
                    f"    {name}: {count} of {report.exported_rows[name]} rows"
                    for name, count in sorted(per_partition.items())
                ]
            for finding in findings[:show]:
                lines.append(f"    {finding.partition + ': ' if finding.partition else ''}{finding.detail}")
            if len(findings) > show:
                lines.append(f"    ... and {len(findings) - show} more")
    count = len(report.problems)
    summary = f"{report.outputs} outputs of {partitions} partitions"
    lines.append(f"verify: {count} problems in {summary}" if count else f"verify: all good, {summary}")
    return "\n".join(lines)


def _format_of(row: dict) -> str:
    """An export's format from the fields of its rows, when no manifest says it."""
    for field_name, export_format in (("loss_mask", "specforge"), ("text", "text"), ("conversations", "sharegpt")):
        if field_name in row:
            return export_format
    return "raw"


def _some(values: set[str], shown: int = 5) -> str:
    listed = ", ".join(repr(value) for value in sorted(values)[:shown])
    return listed + (f" and {len(values) - shown} more" if len(values) > shown else "")
