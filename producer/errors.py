"""Mistakes the user fixes (a wrong path in a setting or an argument), reported by `python -m producer` in one line."""

from __future__ import annotations

import tempfile
from pathlib import Path


class SetupError(Exception):
    """A setting or argument that cannot work: the message is one line naming it."""


def one_line(error: BaseException) -> str:
    """An exception's message with its line breaks folded: libraries' messages run over several lines."""
    return " ".join(str(error).split())


def writable_directory(path: Path, what: str) -> Path:
    """Create `path` if need be and prove that files can be written in it; `what` says where the path comes from.

    Checked before any work, because the writes come last: enqueue writes its rejects report after
    pushing a partition's jobs, export its files after reading every record.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Permission bits alone do not tell (root, read-only mounts): write a file and let it go.
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise SetupError(f"cannot write to the directory {path} ({what}): {one_line(error)}") from error
    return path
