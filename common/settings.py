"""The fleet's one settings object, read from `FLEET_*` environment variables and `.env`."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from common.protocol.keys import PROBATION, QUEUES


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEET_", env_file=".env", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    # Seconds a Redis call may wait for its answer before it fails (and, in a worker, is sent again).
    redis_timeout: float = Field(30.0, gt=0)
    # Comma-separated: each request goes to the healthy server with the fewest requests in flight.
    sglang_url: Annotated[list[str], NoDecode] = ["http://127.0.0.1:30000"]
    sglang_api_key: SecretStr | None = None

    data_dir: Path = Path("data")
    # The output store: a directory every worker can write to, or object storage (s3://bucket/prefix,
    # gs://..., az://...) with credentials from the cloud's standard environment variables.
    output_dir: str = "output"
    # An S3-compatible server of one's own (MinIO, SeaweedFS) for an s3:// output store.
    s3_endpoint_url: str | None = None
    tokenizer: str = "sample/tokenizer"
    # Prompt tokens + max_new_tokens above this are rejected at enqueue time.
    context_length: int = Field(32768, gt=0)

    short_max_new_tokens: int = Field(10240, gt=0)
    long_max_new_tokens: int = Field(16384, gt=0)
    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)

    # Jobs in flight per queue across the whole fleet: every worker process on every host together.
    short_concurrency: int = Field(150, gt=0)
    long_concurrency: int = Field(32, gt=0)
    # A smaller limit for one worker process within the fleet cap; unset, one process may take the whole cap.
    worker_short_concurrency: int | None = Field(None, gt=0)
    worker_long_concurrency: int | None = Field(None, gt=0)

    # A worker's in-flight jobs are leased for `lease_ttl` seconds and renewed every `heartbeat_interval`;
    # a worker killed with SIGKILL loses its leases and its jobs are requeued by any live worker.
    heartbeat_interval: float = Field(5.0, gt=0)
    lease_ttl: int = Field(20, gt=0)
    # How long a SIGTERMed worker lets in-flight generations finish before requeueing them.
    shutdown_grace: float = Field(60.0, ge=0)
    # Attempts per job for transient failures (aborted generations, 5xx) while the server is healthy.
    max_attempts: int = Field(5, gt=0)
    # Server crashes or disconnects one job may live through in a plain `rq worker` (they cost no attempt).
    max_server_failures: int = Field(10, gt=0)
    # Times a FleetWorker's job may be running alone on a server when it goes down before the job fails as
    # crashing the server (worker/probation.py: the jobs in flight at a crash are tried in ever smaller groups).
    max_crashes_alone: int = Field(2, gt=0)
    retry_backoff: float = Field(1.0, gt=0)
    retry_backoff_max: float = Field(30.0, gt=0)
    connect_timeout: float = Field(10.0, gt=0)
    # Finished jobs stay in Redis this long; the output store, not Redis, keeps the results.
    result_ttl: int = Field(600, ge=0)

    # The SGLang server run by `python -m server plan | launch | supervise` (docs/server.md).
    # A local model directory: the plan reads its config.json and weight index.
    model_path: str = ""
    tp: int = Field(1, gt=0)
    mem_fraction_static: float = Field(0.88, gt=0, lt=1)
    kv_cache_dtype: str = Field("auto", pattern="^(auto|bf16|fp8_e4m3|fp8_e5m2)$")
    # GB (10^9 bytes) of host memory PER TP RANK, as SGLang reads --hicache-size: 48 at TP 8 is 384 GB.
    hicache_size: int = Field(0, ge=0)
    # Used when hicache_size is 0: host cache = GPU KV cache x this; both 0 turn the hierarchical cache off.
    hicache_ratio: float = Field(0.0, ge=0)
    # SGLang's --context-length; unset, SGLang takes the model's.
    server_context_length: int | None = Field(None, gt=0)
    server_host: str = "127.0.0.1"
    server_port: int = Field(30000, gt=0, lt=65536)
    # Further SGLang flags, shell-quoted, e.g. "--trust-remote-code --reasoning-parser kimi_k2".
    server_args: str = ""
    # Replaces the whole SGLang command (stand-ins for tests): {host}, {port} and {mem_fraction_static}
    # are filled in. Such a command is not SGLang, so it is not planned.
    server_command: str = ""
    server_log: Path = Path("run/sglang.log")
    # Per-GPU planning assumptions in GiB (server/capacity.py `Assumptions` says where they come from).
    cuda_context_gib: float = Field(2.4, ge=0)
    runtime_overhead_gib: float = Field(5.7, ge=0)
    min_headroom_gib: float = Field(4.0, ge=0)
    # Supervision: seconds to first health, between health checks, and of failed checks before a restart.
    startup_timeout: float = Field(1800.0, gt=0)
    health_interval: float = Field(5.0, gt=0)
    unhealthy_after: float = Field(60.0, gt=0)
    restart_backoff: float = Field(5.0, ge=0)
    restart_backoff_max: float = Field(300.0, ge=0)
    # After an out-of-memory crash mem_fraction_static drops by oom_step, never below mem_fraction_floor.
    oom_step: float = Field(0.02, gt=0, lt=1)
    mem_fraction_floor: float = Field(0.80, gt=0, lt=1)
    # How long to wait for leftover processes to release GPU memory before refusing to (re)launch.
    gpu_free_timeout: float = Field(120.0, ge=0)
    # A JSON file standing in for NVML (server/gpu.py); unset, NVML is asked.
    gpu_probe_file: Path | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        # SGLang's SamplingParams.verify() refuses anything else with HTTP 400, for every job.
        if value != -1 and value < 1:
            raise ValueError("must be -1 (no limit) or at least 1, as SGLang requires")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        return value

    @field_validator("sglang_url", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [url.strip().rstrip("/") for url in value.split(",") if url.strip()]
        if not value:
            raise ValueError("needs at least one URL")
        return value

    def max_new_tokens(self, queue: str) -> int:
        return self.long_max_new_tokens if queue == "long" else self.short_max_new_tokens

    def concurrency(self, queue: str) -> int:
        """The fleet-wide cap on `queue`'s jobs in flight; probation's own cap, kept in Redis, stays within both."""
        if queue == PROBATION:
            return self.short_concurrency + self.long_concurrency
        return self.long_concurrency if queue == "long" else self.short_concurrency

    def worker_concurrency(self, queue: str) -> int:
        if queue == PROBATION:
            return sum(self.worker_concurrency(name) for name in QUEUES)
        bound = self.worker_long_concurrency if queue == "long" else self.worker_short_concurrency
        return min(bound or self.concurrency(queue), self.concurrency(queue))

    def sampling_defaults(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}

    @property
    def redis_url_redacted(self) -> str:
        """The Redis URL without user, password or query (which may carry `password=`): fit for logs and status."""
        parts = urlsplit(self.redis_url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port else ""
        return urlunsplit((parts.scheme, host + port, parts.path, "", ""))


_SECRET_FIELDS = {"redis_url", "sglang_api_key"}


def describe_error(error: ValidationError) -> str:
    """One line naming each bad variable, e.g. `FLEET_LONG_CONCURRENCY: Input should be greater than 0`."""
    problems = []
    for item in error.errors():
        field = str(item["loc"][0]) if item["loc"] else ""
        shown = "" if field in _SECRET_FIELDS else f" (got {item.get('input')!r})"
        problems.append(f"FLEET_{field.upper()}: {item['msg']}{shown}")
    return "invalid settings: " + "; ".join(problems)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Load settings once; a bad value exits with one line naming the variable."""
    try:
        return Settings()
    except ValidationError as error:
        sys.exit(describe_error(error))
