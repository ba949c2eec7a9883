"""The output store in object storage (S3 and S3-compatible servers, Google Cloud Storage, Azure Blob Storage).

A record is committed with a conditional create (`If-None-Match: *`, obstore's `mode="create"`): the first
PUT of a key wins and every later one is refused, whichever host sends it, and an object becomes visible only
once its upload is complete. Endpoint and credentials come from each cloud's standard environment variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, GOOGLE_SERVICE_ACCOUNT, AZURE_STORAGE_ACCOUNT_NAME,
...), which obstore reads; FLEET_S3_ENDPOINT_URL points S3 at a server of one's own (MinIO, SeaweedFS).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, NotFoundError, PreconditionError
from obstore.store import from_url

from common.store.base import OutputStore, StoreError

OBJECT_SCHEMES = ("s3", "s3a", "gs", "az", "abfs", "abfss")
# A create that races another one on the same key may be told to try again (HTTP 409) rather than refused.
CONFLICT_RETRIES, CONFLICT_PAUSE = 10, 0.2


class ObjectStore(OutputStore):
    def __init__(self, url: str, s3_endpoint_url: str | None = None) -> None:
        self.location = url.rstrip("/")
        options: dict[str, Any] = {}
        if s3_endpoint_url and url.startswith(("s3://", "s3a://")):
            options["endpoint"] = s3_endpoint_url
            if s3_endpoint_url.startswith("http://"):
                options["client_options"] = {"allow_http": True}
        try:
            self.store = from_url(self.location, **options)
        except (BaseError, ValueError) as error:
            raise StoreError(f"cannot open the output store {self.location}: {_one_line(error)}") from error

    def create(self, key: str, data: bytes) -> bool:
        for _ in range(CONFLICT_RETRIES):
            try:
                obstore.put(self.store, key, data, mode="create")
                return True
            except AlreadyExistsError:
                return False
            except PreconditionError:
                # Another create of this key is in progress: once it is done the key exists, or it failed.
                time.sleep(CONFLICT_PAUSE)
                if self.exists(key):
                    return False
            except (BaseError, OSError) as error:
                raise StoreError(f"cannot write {self.location}/{key}: {_one_line(error)}") from error
        raise StoreError(f"cannot write {self.location}/{key}: other writers kept it busy")

    def replace(self, key: str, data: bytes) -> None:
        try:
            obstore.put(self.store, key, data)
        except (BaseError, OSError) as error:
            raise StoreError(f"cannot write {self.location}/{key}: {_one_line(error)}") from error

    def read(self, key: str) -> bytes | None:
        try:
            return bytes(obstore.get(self.store, key).bytes())
        except (FileNotFoundError, NotFoundError):
            return None
        except (BaseError, OSError) as error:
            raise StoreError(f"cannot read {self.location}/{key}: {_one_line(error)}") from error

    def read_range(self, key: str, start: int, end: int) -> bytes:
        try:
            return bytes(obstore.get_range(self.store, key, start=start, end=end))
        except (FileNotFoundError, NotFoundError) as error:
            raise FileNotFoundError(f"{self.location}/{key}") from error
        except (BaseError, OSError) as error:
            raise StoreError(f"cannot read {self.location}/{key}: {_one_line(error)}") from error

    def exists(self, key: str) -> bool:
        try:
            obstore.head(self.store, key)
        except (FileNotFoundError, NotFoundError):
            return False
        except (BaseError, OSError) as error:
            raise StoreError(f"cannot read {self.location}/{key}: {_one_line(error)}") from error
        return True

    def keys(self, prefix: str) -> Iterator[str]:
        try:
            for batch in obstore.list(self.store, prefix, chunk_size=1000):
                for meta in batch:
                    yield meta["path"]
        except (BaseError, OSError) as error:
            raise StoreError(f"cannot list {self.location}/{prefix}: {_one_line(error)}") from error

    def folders(self, prefix: str) -> list[str]:
        try:
            listing = obstore.list_with_delimiter(self.store, prefix)
        except (BaseError, OSError) as error:
            raise StoreError(f"cannot list {self.location}/{prefix}: {_one_line(error)}") from error
        return [path.rstrip("/").rsplit("/", 1)[-1] for path in listing["common_prefixes"]]

    def problem(self) -> str | None:
        probe = f".writable/{uuid.uuid4().hex}"
        try:
            obstore.put(self.store, probe, b"", mode="create")
            obstore.delete(self.store, probe)
        except (BaseError, OSError) as error:
            return f"cannot write outputs under {self.location}: {_one_line(error)}"
        return None


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]
