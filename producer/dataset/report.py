"""What `verify` found: problems (exit 1) and notes, counted per kind and partition, with the first few shown."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from producer.wording import plural

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
    "stale": "outputs of an earlier version of a prompt, edited since (not exported; enqueue generates the new)",
    "drift": "exported rows a trainer would tokenize into other tokens than the generated ones"
    " (--format specforge keeps them exact)",
}
# Kinds shown with a count per partition, against the rows read.
PER_ROW = ("drift", "tokens")


@dataclass
class Finding:
    kind: str
    partition: str
    detail: str


@dataclass
class Report:
    """Findings are counted, and only the first `keep` of each kind kept: a million of them must not fill memory."""

    keep: int = 20
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    examples: defaultdict[str, list[Finding]] = field(default_factory=lambda: defaultdict(list))
    outputs: int = 0
    # Rows read per exported partition: what the drift notes are counted against.
    exported_rows: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, partition: str, detail: str) -> None:
        self.counts[(kind, partition)] += 1
        if len(self.examples[kind]) < self.keep:
            self.examples[kind].append(Finding(kind, partition, detail))

    def count(self, kind: str) -> int:
        return sum(count for (found, _), count in self.counts.items() if found == kind)

    @property
    def problems(self) -> int:
        return sum(self.count(kind) for kind in PROBLEMS)

    def render(self, partitions: int) -> str:
        lines = []
        for heading, kinds in (("PROBLEMS", PROBLEMS), ("notes", NOTES)):
            found = [kind for kind in kinds if self.count(kind)]
            if not found:
                continue
            lines.append(heading)
            for kind in found:
                total = self.count(kind)
                lines.append(f"  {kinds[kind]} ({total}):")
                if kind in PER_ROW:
                    per_partition = sorted((name, count) for (each, name), count in self.counts.items() if each == kind)
                    lines += [
                        f"    {name}: {count} of {self.exported_rows[name]} rows" for name, count in per_partition
                    ]
                for finding in self.examples[kind]:
                    lines.append(f"    {finding.partition + ': ' if finding.partition else ''}{finding.detail}")
                if total > len(self.examples[kind]):
                    lines.append(f"    ... and {total - len(self.examples[kind])} more")
        summary = f"{plural(self.outputs, 'output')} of {plural(partitions, 'partition')}"
        problems = plural(self.problems, "problem")
        lines.append(f"verify: {problems} in {summary}" if self.problems else f"verify: all good, {summary}")
        return "\n".join(lines)
