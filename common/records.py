"""Every record one process writes and another reads: through Redis or through the output store.

- GenerationJob: the producer's job arguments, read by a worker;
- GenerationResult: what a worker returns for a job (RQ keeps it as the job's result);
- OutputRecord: a committed sample, read by export, verify and status;
- WorkerReport: a worker's own report, refreshed every heartbeat, read by `status`;
- ServerMetrics: the supervisor's view of its server and the server's decode figures, read by `status`;
- Totals: the running totals of committed samples and tokens, read by `status`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class PromptRef(BaseModel):
    """Where a prompt's ids are in the output store: `length` tokens from token `offset` of the object `key`."""

    model_config = ConfigDict(extra="forbid")

    key: str
    offset: int = Field(ge=0)
    length: int = Field(gt=0)


class GenerationJob(BaseModel):
    """The keyword arguments of one `worker.jobs.generate` job, as the producer writes them into Redis.

    The prompt's ids are in the output store (`prompt`), so that a pending job costs Redis the same few
    hundred bytes whatever the prompt's length; jobs made before that carry the ids themselves (`input_ids`).
    """

    model_config = ConfigDict(extra="forbid")

    partition: str
    sample_id: str | int
    prompt: PromptRef | None = None
    input_ids: list[int] | None = Field(None, min_length=1)
    sampling_params: dict[str, Any]
    # What the sample is generated from (producer.prompts.prompt_version); empty in jobs made before versions.
    version: str = ""

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerationJob:
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("a job carries exactly one of prompt (a reference into the store) and input_ids")
        return self

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
    # The job's version of the sample (GenerationJob.version); empty in records made before versions.
    version: str = ""
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


class GenerationResult(BaseModel):
    """The result of one generation job: whether this execution committed the sample, and what it made."""

    committed: bool
    # Another execution committed the sample first: this one's output was discarded.
    duplicate: bool = False
    # Why nothing was generated, when the sample was found committed before generating.
    skipped: str | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0


class ServerSeen(BaseModel):
    """One server as one worker sees it."""

    url: str
    healthy: bool
    in_flight: int = 0
    down_since: float | None = None


class WorkerReport(BaseModel):
    """A FleetWorker's report of itself (`worker_state_key`), expiring with its heartbeat."""

    name: str
    host: str | None = None
    pid: int | None = None
    queues: list[str] = Field(default_factory=list)
    in_flight: dict[str, int] = Field(default_factory=dict)
    slots: dict[str, int] = Field(default_factory=dict)
    servers: list[ServerSeen] = Field(default_factory=list)
    # UNIX time of the worker's clock at its last heartbeat.
    heartbeat_at: float

    def to_json(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))


class ServerMetrics(BaseModel):
    """The Redis hash of one server (`server_metrics_key`): every field optional, each written when known.

    The supervisor writes its own view (state, reason, pid, restarts, mem_fraction_static, state_at) and the
    figures of the latest decode line in SGLang's log (the rest, with updated_at).
    """

    state: str | None = None
    reason: str | None = None
    pid: int | None = None
    restarts: int | None = None
    mem_fraction_static: float | None = None
    state_at: float | None = None
    running_req: float | None = None
    token: float | None = None
    token_usage: float | None = None
    cuda_graph: str | None = None
    gen_throughput: float | None = None
    queue_req: float | None = None
    updated_at: float | None = None

    def to_hash(self) -> dict[str, str | int | float]:
        """The fields that are set, as HSET takes them."""
        return self.model_dump(exclude_none=True)

    @classmethod
    def parse(cls, values: dict[str, Any]) -> ServerMetrics:
        """The known fields that parse: one that does not (a log line SGLang changed) is left unknown."""
        known = {name: value for name, value in values.items() if name in cls.model_fields}
        try:
            return cls.model_validate(known)
        except ValidationError as error:
            bad = {str(item["loc"][0]) for item in error.errors()}
            return cls.model_validate({name: value for name, value in known.items() if name not in bad})

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> ServerMetrics:
        return cls.parse({key.decode(): value.decode() for key, value in fields.items()})


def figure(text: str | None) -> float | None:
    """A number as SGLang prints it (in a decode log line, or on /metrics), or None if it is not one."""
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


class Totals(BaseModel):
    """The running totals of committed samples and generated tokens (`TOTALS_KEY`), for throughput."""

    samples: int = 0
    tokens: int = 0
    # UNIX time of the first commit of the run.
    first_at: float | None = None

    @classmethod
    def from_hash(cls, fields: dict[bytes, bytes]) -> Totals:
        return cls.model_validate({key.decode(): value.decode() for key, value in fields.items()})
