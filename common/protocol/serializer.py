"""How job data, results and metadata are written in Redis: pickle, of plain values only.

RQ reads job data with pickle unless told otherwise, so `rq worker short long`, typed as is, reads the
fleet's jobs: the producer writes each job's data as a pickle of plain values (str, int, float, bool, None,
bytes, lists, tuples, dicts), which any RQ worker and rq-dashboard read. The fleet itself reads them with an
unpickler that admits no class at all: nothing a job in Redis names is imported, and no object of a class it
names is ever built. Jobs that earlier versions wrote as JSON are still read.
"""

from __future__ import annotations

import io
import json
import pickle
from typing import Any

_JSON_STARTS = (b"[", b"{")


class PlainPickle:
    """An RQ serializer (`dumps`, `loads`) of plain data."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=4)

    @staticmethod
    def loads(data: bytes) -> Any:
        if data[:1] in _JSON_STARTS:
            return json.loads(data)
        return _PlainUnpickler(io.BytesIO(data)).load()


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"job data names {module}.{name}: only plain values are read")
