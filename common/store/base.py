"""What every output store offers: a handful of byte-level operations each backend implements, and on top of
them the fleet's own layout, under the store's root:

    samples/<partition>/<shard>/<job id>.json   one record per committed sample (common.records.OutputRecord)
    rejects/<partition>.jsonl                   the records enqueue refused, and why
    prompts/<partition>/<digest>.u32            tokenized prompts, which pending jobs refer to

A sample is committed with a conditional create: of several executions of one sample, exactly one commit
wins, and a reader sees either no record or a whole one, whatever moment a process is killed at.
"""

from __future__ import annotations

import hashlib
import sys
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterator

from common.records import OutputRecord, PromptRef

SAMPLES, REJECTS, PROMPTS = "samples", "rejects", "prompts"
_SUFFIX = ".json"
# Token ids as unsigned 32-bit little-endian integers: 4 bytes a token, whatever the vocabulary.
_TOKEN = next(code for code in "IL" if array(code).itemsize == 4)
_SWAP = sys.byteorder == "big"


class StoreError(Exception):
    """The store cannot be read or written now; the message says where and why."""


class OutputStore(ABC):
    #: Where the store is, for messages: a directory or a URL (never with credentials).
    location: str

    # What each backend implements. Keys are '/'-separated paths under the store's root.

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """Write `data` unless `key` exists; True when this call wrote it. Visible only whole, or not at all."""

    @abstractmethod
    def replace(self, key: str, data: bytes) -> None:
        """Write `data` at `key`, replacing what is there; visible only whole."""

    @abstractmethod
    def read(self, key: str) -> bytes | None:
        """The bytes at `key`, or None if there is nothing."""

    @abstractmethod
    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes `start` to `end` (exclusive) of `key`; FileNotFoundError if there is no `key`."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self, prefix: str) -> Iterator[str]:
        """Every key under `prefix/`, in no particular order, temporary files left out."""

    @abstractmethod
    def folders(self, prefix: str) -> list[str]:
        """The names of the folders directly under `prefix/`."""

    @abstractmethod
    def problem(self) -> str | None:
        """Why records cannot be committed here, if they cannot: checked before any generation is spent."""

    def remove_leftovers(self) -> int:
        """Remove the temporary files that writers killed mid-write left; how many. A store whose writes leave
        nothing behind has none."""
        return 0

    # Samples.

    def sample_key(self, partition: str, job_id: str) -> str:
        # A shard spreads a partition's 100,000s of records over 256 folders (or key prefixes).
        shard = hashlib.blake2b(job_id.encode(), digest_size=1).hexdigest()
        return f"{SAMPLES}/{partition}/{shard}/{job_id}{_SUFFIX}"

    def commit(self, record: OutputRecord) -> bool:
        """Write `record` unless its sample is already committed; True when this call wrote it."""
        return self.create(self.sample_key(record.partition, record.job_id), record.to_json())

    def load(self, partition: str, job_id: str) -> OutputRecord | None:
        data = self.read(self.sample_key(partition, job_id))
        return None if data is None else OutputRecord.from_json(data)

    def has(self, partition: str, job_id: str) -> bool:
        return self.exists(self.sample_key(partition, job_id))

    def sample_keys(self, partition: str) -> Iterator[str]:
        """The keys of `partition`'s committed records, in no particular order."""
        return (key for key in self.keys(f"{SAMPLES}/{partition}") if key.endswith(_SUFFIX))

    def done(self, partition: str) -> set[str]:
        """The job IDs committed for `partition`, from listings alone."""
        return {job_id_of(key) for key in self.sample_keys(partition)}

    def partitions(self) -> list[str]:
        """The partitions with a folder of records."""
        return sorted(self.folders(SAMPLES))

    # Tokenized prompts: written once per batch, read by the worker that runs each prompt.

    def write_prompts(self, partition: str, prompts: list[list[int]]) -> list[PromptRef]:
        """Store a batch of prompts' ids in one object named by its content; a reference to each prompt in it.

        The same batch written twice (enqueue run again, two producers) is the same object, written once.
        """
        data = array(_TOKEN)
        refs = []
        for ids in prompts:
            refs.append(PromptRef(key="", offset=len(data), length=len(ids)))
            data.extend(ids)
        if _SWAP:
            data.byteswap()
        payload = data.tobytes()
        key = f"{PROMPTS}/{partition}/{hashlib.blake2b(payload, digest_size=16).hexdigest()}.u32"
        self.create(key, payload)
        return [ref.model_copy(update={"key": key}) for ref in refs]

    def read_prompt(self, ref: PromptRef) -> list[int]:
        ids = array(_TOKEN)
        ids.frombytes(self.read_range(ref.key, 4 * ref.offset, 4 * (ref.offset + ref.length)))
        if _SWAP:
            ids.byteswap()
        if len(ids) != ref.length:
            raise StoreError(f"{self.location}: {ref.key} holds no prompt at {ref.offset} + {ref.length} tokens")
        return ids.tolist()


def job_id_of(key: str) -> str:
    """The job ID a record's key names."""
    return key.rsplit("/", 1)[-1].removesuffix(_SUFFIX)
