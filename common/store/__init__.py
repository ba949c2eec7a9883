"""The output store: one record per completed sample, written once, and the files kept beside the outputs.

Local disk (`local.LocalStore`) or object storage (`objects.ObjectStore`: S3, GCS, Azure), behind one
interface (`base.OutputStore`); `open_store` picks the backend from FLEET_OUTPUT_DIR. The store, not Redis,
is the source of truth for what is done.
"""

from __future__ import annotations

from common.settings import Settings
from common.store.base import OutputStore, StoreError
from common.store.local import LocalStore
from common.store.objects import OBJECT_SCHEMES, ObjectStore

__all__ = ["LocalStore", "ObjectStore", "OutputStore", "StoreError", "open_store"]


def open_store(settings: Settings) -> OutputStore:
    """The store FLEET_OUTPUT_DIR names: a URL of object storage, or a local directory."""
    location = settings.output_dir
    if location.split("://", 1)[0] in OBJECT_SCHEMES and "://" in location:
        return ObjectStore(location, settings.s3_endpoint_url)
    return LocalStore(location)
