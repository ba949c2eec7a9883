"""The output store on a local or shared POSIX filesystem.

A record is written under a temporary name, fsynced, then hard-linked to its final name: `link` fails if the
name exists, so the first commit wins, and a reader sees either no file or a whole one. New folders are
fsynced too, so that a power loss cannot lose a folder of outputs. Temporary files live in one folder, `.tmp`,
where a worker that starts removes those that a killed writer left.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

from common.store.base import PROMPTS, REJECTS, SAMPLES, OutputStore, StoreError

TEMPORARY = ".tmp"
# A temporary file this old was left by a killed writer: a write takes moments. Its age is the file server's
# clock against this host's; were they further apart than this, a file being written could go, and its commit
# would fail with a StoreError, which the worker retries.
LEFTOVER_AGE = 6 * 3600


class LocalStore(OutputStore):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.location = str(self.root)

    def path(self, key: str) -> Path:
        return self.root / key

    def create(self, key: str, data: bytes) -> bool:
        final = self.path(key)
        try:
            if final.exists():
                return False
            self._make_dirs(final.parent)
            temporary = self._write_temporary(final, data)
            try:
                os.link(temporary, final)
            except FileExistsError:
                return False
            finally:
                temporary.unlink(missing_ok=True)
            _fsync_dir(final.parent)
        except OSError as error:
            raise StoreError(f"cannot write {final}: {error.strerror or error}") from error
        return True

    def replace(self, key: str, data: bytes) -> None:
        final = self.path(key)
        try:
            self._make_dirs(final.parent)
            os.replace(self._write_temporary(final, data), final)
            _fsync_dir(final.parent)
        except OSError as error:
            raise StoreError(f"cannot write {final}: {error.strerror or error}") from error

    def read(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise StoreError(f"cannot read {self.path(key)}: {error.strerror or error}") from error

    def read_range(self, key: str, start: int, end: int) -> bytes:
        try:
            with open(self.path(key), "rb") as file:
                file.seek(start)
                return file.read(end - start)
        except FileNotFoundError:
            raise
        except OSError as error:
            raise StoreError(f"cannot read {self.path(key)}: {error.strerror or error}") from error

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def keys(self, prefix: str) -> Iterator[str]:
        base = self.path(prefix)
        if not base.is_dir():
            return
        for directory, folders, files in os.walk(base):
            folders[:] = sorted(folder for folder in folders if not folder.startswith("."))
            relative = Path(directory).relative_to(self.root).as_posix()
            for name in files:
                if not name.startswith("."):
                    yield name if relative == "." else f"{relative}/{name}"

    def folders(self, prefix: str) -> list[str]:
        base = self.path(prefix)
        if not base.is_dir():
            return []
        return [entry.name for entry in base.iterdir() if entry.is_dir() and not entry.name.startswith(".")]

    def problem(self) -> str | None:
        for folder in (self.root, *(self.root / name for name in (SAMPLES, REJECTS, PROMPTS))):
            try:
                folder.mkdir(parents=True, exist_ok=True)
                probe = folder / f".writable.{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as error:
                return f"cannot write outputs under {folder}: {error.strerror or error}"
        return self._commit_problem()

    def _commit_problem(self) -> str | None:
        """What a commit needs of the filesystem: hard links and directory fsync, which FUSE mounts of object
        storage (gcsfuse, s3fs-fuse, blobfuse) lack; every job would generate, then fail to commit."""
        probe = self.root / f".probe.{os.getpid()}"
        linked = probe.with_name(probe.name + ".link")
        try:
            probe.write_bytes(b"")
            os.link(probe, linked)
            _fsync_dir(self.root)
        except OSError as error:
            return (
                f"cannot commit outputs under {self.root}: {error.strerror or error} (a commit links a file into"
                " place and fsyncs its folder); put the outputs in object storage instead: FLEET_OUTPUT_DIR=s3://..."
            )
        finally:
            probe.unlink(missing_ok=True)
            linked.unlink(missing_ok=True)
        return None

    def remove_leftovers(self) -> int:
        temporaries = self.root / TEMPORARY
        cutoff, removed = time.time() - LEFTOVER_AGE, 0
        try:
            with os.scandir(temporaries) as entries:
                for entry in entries:
                    try:
                        if entry.stat().st_mtime < cutoff:
                            os.unlink(entry.path)
                            removed += 1
                    except FileNotFoundError:
                        continue  # another worker removed it first
        except FileNotFoundError:
            pass
        except OSError as error:
            raise StoreError(f"cannot clean {temporaries}: {error.strerror or error}") from error
        return removed

    def _write_temporary(self, final: Path, data: bytes) -> Path:
        """`data` in a fsynced file in the temporary folder, which listings skip."""
        self._make_dirs(self.root / TEMPORARY)
        temporary = self.root / TEMPORARY / f"{final.name}.{os.getpid()}.{os.urandom(4).hex()}"
        try:
            with open(temporary, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return temporary

    def _make_dirs(self, directory: Path) -> None:
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
