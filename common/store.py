"""The output store: one file per completed sample, written once, durably and atomically.

Layout: `<root>/<partition>/<shard>/<job_id>.json`, where the shard spreads 100,000s of files over
256 folders. A commit writes a temporary file, fsyncs it, then hard-links it to its final name:
`link` fails if the name exists, so the first commit wins, and a reader sees either no file or a
whole one, whatever moment a process is killed at. The store, not Redis, is the source of truth
for what is done.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from common.records import OutputRecord

_SUFFIX = ".json"


class OutputStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, partition: str, job_id: str) -> Path:
        shard = hashlib.blake2b(job_id.encode(), digest_size=1).hexdigest()
        return self.root / partition / shard / f"{job_id}{_SUFFIX}"

    def exists(self, partition: str, job_id: str) -> bool:
        return self.path(partition, job_id).exists()

    def commit(self, record: OutputRecord) -> bool:
        """Write `record` unless its sample is already committed; True when this call wrote it."""
        final = self.path(record.partition, record.job_id)
        if final.exists():
            return False
        if not final.parent.is_dir():
            self._make_dirs(final.parent)
        temporary = final.parent / f".{record.job_id}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        try:
            with open(temporary, "wb") as file:
                file.write(record.to_json())
                file.flush()
                os.fsync(file.fileno())
            try:
                os.link(temporary, final)
            except FileExistsError:
                return False
            _fsync_dir(final.parent)
            return True
        finally:
            temporary.unlink(missing_ok=True)

    def writable(self) -> str | None:
        """Why outputs cannot be committed here, if they cannot: checked before any generation is spent."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".writable.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            return f"cannot write outputs under {self.root}: {error.strerror or error}"
        return None

    def load(self, partition: str, job_id: str) -> OutputRecord | None:
        try:
            return OutputRecord.from_json(self.path(partition, job_id).read_bytes())
        except FileNotFoundError:
            return None

    def done(self, partition: str) -> set[str]:
        """The job IDs committed for `partition`, from directory listings alone."""
        return {path.name.removesuffix(_SUFFIX) for path in self.files(partition)}

    def partitions(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(entry.name for entry in self.root.iterdir() if entry.is_dir())

    def files(self, partition: str) -> Iterator[Path]:
        """The committed outputs' files of `partition`, in no particular order; temporary files left out."""
        base = self.root / partition
        if not base.is_dir():
            return
        for shard in base.iterdir():
            if shard.is_dir():
                with os.scandir(shard) as entries:
                    for entry in entries:
                        if entry.name.endswith(_SUFFIX) and not entry.name.startswith("."):
                            yield Path(entry.path)

    def _make_dirs(self, directory: Path) -> None:
        """Create `directory` and make each new entry durable, so that a power loss cannot lose a folder of outputs."""
        missing = []
        while not directory.is_dir():
            missing.append(directory)
            directory = directory.parent
        for folder in reversed(missing):
            folder.mkdir(exist_ok=True)
            _fsync_dir(folder.parent)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
