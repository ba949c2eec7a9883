"""Partitions: each `<data_dir>/<name>.jsonl` file, with options from `<data_dir>/partitions.toml`.

    [B3_long]
    queue = "long"
    max_new_tokens = 16384
    temperature = 0.7

A partition not listed there goes to the `short` queue with the settings' defaults.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.settings import Settings

OPTIONS_FILE = "partitions.toml"


class PartitionError(Exception):
    """A partition that cannot be read: the message is one line naming it."""


class PartitionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError("must be -1 (no limit) or at least 1, as SGLang requires")
        return value

    queue: Literal["short", "long"] = "short"
    max_new_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    stop: list[str] | None = None


@dataclass(frozen=True)
class Partition:
    name: str
    path: Path
    options: PartitionOptions

    @property
    def queue(self) -> str:
        return self.options.queue

    def max_new_tokens(self, settings: Settings) -> int:
        return self.options.max_new_tokens or settings.max_new_tokens(self.queue)

    def sampling_params(self, settings: Settings) -> dict[str, Any]:
        """SGLang sampling params for this partition's jobs: everything explicit, nothing left to server defaults.

        `skip_special_tokens` is off so that reasoning and tool-call markers survive in `text`.
        """
        overrides = self.options.model_dump(exclude={"queue", "max_new_tokens"}, exclude_none=True)
        params = settings.sampling_defaults() | overrides
        return params | {"max_new_tokens": self.max_new_tokens(settings), "skip_special_tokens": False}


def load_partitions(data_dir: Path, names: list[str]) -> list[Partition]:
    """The partitions named (or every one for `all`), in name order."""
    if not data_dir.is_dir():
        raise PartitionError(f"data directory {data_dir} does not exist (set FLEET_DATA_DIR)")
    available = {path.stem: path for path in sorted(data_dir.glob("*.jsonl"))}
    options = _read_options(data_dir / OPTIONS_FILE)
    for name in options:
        if name not in available:
            raise PartitionError(f"{data_dir / OPTIONS_FILE}: table [{name}] names no {name}.jsonl in {data_dir}")
    check_known(names, set(available), data_dir)
    wanted = sorted(available) if names in ([], ["all"]) else names
    return [Partition(name, available[name], options.get(name, PartitionOptions())) for name in wanted]


def check_known(names: list[str], known: set[str], data_dir: Path) -> None:
    """Refuse partition names that are neither in the data directory nor enqueued before, as load_partitions does."""
    if names in ([], ["all"]):
        return
    unknown = [name for name in names if name not in known]
    if unknown:
        listing = ", ".join(sorted(known)) or "none"
        raise PartitionError(f"unknown partition(s) {', '.join(unknown)} in {data_dir}; available: {listing}")


def stray_files(data_dir: Path) -> list[str]:
    """Files in the data directory that are not partitions (`<name>.jsonl`) or their options."""
    if not data_dir.is_dir():
        return []
    return sorted(
        path.name
        for path in data_dir.iterdir()
        if path.is_file() and not path.name.startswith(".") and path.suffix != ".jsonl" and path.name != OPTIONS_FILE
    )


def _read_options(path: Path) -> dict[str, PartitionOptions]:
    if not path.exists():
        return {}
    try:
        tables = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise PartitionError(f"{path}: {error}") from error
    options = {}
    for name, table in tables.items():
        try:
            options[name] = PartitionOptions.model_validate(table)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise PartitionError(f"{path}: [{name}] {problems}") from error
    return options
