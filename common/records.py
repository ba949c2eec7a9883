"""The two records that cross process boundaries: a generation job's arguments and a committed output."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator


class GenerationJob(BaseModel):
    """The keyword arguments of one `worker.jobs.generate` job, as the producer writes them into Redis."""

    model_config = ConfigDict(extra="forbid")

    partition: str
    sample_id: str | int
    input_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any]

    @field_validator("partition")
    @classmethod
    def _folder_name(cls, partition: str) -> str:
        """A partition names a folder of the output store: nothing that would lead outside it."""
        if not partition or partition in (".", "..") or any(char in partition for char in "/\\\0"):
            raise ValueError(f"not a partition name: {partition!r}")
        return partition


class OutputRecord(BaseModel):
    """One completed sample, committed once under the output directory."""

    id: str | int
    partition: str
    job_id: str
    input_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    sampling_params: dict[str, Any]
    server: str
    # What the server reported of itself (`/model_info` model_path, `/server_info` version).
    model: str = ""
    server_version: str = ""
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def from_json(cls, data: bytes) -> OutputRecord:
        return cls.model_validate(orjson.loads(data))
