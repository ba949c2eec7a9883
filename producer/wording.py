"""Counts in words: "1 job", "2 jobs"."""

from __future__ import annotations


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
