"""The fleet's one settings object, read from `FLEET_*` environment variables and `.env`."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLEET_", env_file=".env", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    # Comma-separated: each request goes to the healthy server with the fewest requests in flight.
    sglang_url: Annotated[list[str], NoDecode] = ["http://127.0.0.1:30000"]
    sglang_api_key: SecretStr | None = None

    data_dir: Path = Path("data")
    output_dir: Path = Path("output")
    tokenizer: str = "sample/tokenizer"
    # Prompt tokens + max_new_tokens above this are rejected at enqueue time.
    context_length: int = Field(32768, gt=0)

    short_max_new_tokens: int = Field(10240, gt=0)
    long_max_new_tokens: int = Field(16384, gt=0)
    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)

    short_concurrency: int = Field(150, gt=0)
    long_concurrency: int = Field(32, gt=0)

    # A worker's in-flight jobs are leased for `lease_ttl` seconds and renewed every `heartbeat_interval`;
    # a worker killed with SIGKILL loses its leases and its jobs are requeued by any live worker.
    heartbeat_interval: float = Field(5.0, gt=0)
    lease_ttl: int = Field(20, gt=0)
    # How long a SIGTERMed worker lets in-flight generations finish before requeueing them.
    shutdown_grace: float = Field(60.0, ge=0)
    # Attempts per job for transient failures (aborted generations, 5xx) while the server is healthy.
    max_attempts: int = Field(5, gt=0)
    retry_backoff: float = Field(1.0, gt=0)
    retry_backoff_max: float = Field(30.0, gt=0)
    connect_timeout: float = Field(10.0, gt=0)
    # Finished jobs stay in Redis this long; the output store, not Redis, keeps the results.
    result_ttl: int = Field(600, ge=0)

    @field_validator("sglang_url", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [url.strip().rstrip("/") for url in value.split(",") if url.strip()]
        if not value:
            raise ValueError("needs at least one URL")
        return value

    @property
    def samples_dir(self) -> Path:
        """Where the output store keeps one file per completed sample."""
        return self.output_dir / "samples"

    @property
    def rejects_dir(self) -> Path:
        """Where the producer lists, per partition, the records it refused and why."""
        return self.output_dir / "rejects"

    def max_new_tokens(self, queue: str) -> int:
        return self.long_max_new_tokens if queue == "long" else self.short_max_new_tokens

    def concurrency(self, queue: str) -> int:
        return self.long_concurrency if queue == "long" else self.short_concurrency

    def sampling_defaults(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}

    @property
    def redis_url_redacted(self) -> str:
        """The Redis URL without its password, fit for logs and status output."""
        parts = urlsplit(self.redis_url)
        if parts.password is None:
            return self.redis_url
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))


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
