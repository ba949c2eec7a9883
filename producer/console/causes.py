"""Why jobs failed: each failed job's latest failure from RQ, reduced to a cause that similar failures share."""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from redis import Redis
from rq.results import Result

from common.protocol.serializer import PlainPickle

_URL_THEN_COLON = re.compile(r"https?://\S+?: ")
_URL = re.compile(r"https?://\S+")
# Numbers vary between otherwise equal failures (token counts, ports); HTTP status codes tell causes apart.
_NUMBER = re.compile(r"(?<!HTTP )(?<![\w.])\d+(?:\.\d+)?(?![\w.])")
_CLASS = re.compile(r"[A-Za-z_][\w.]*")
CAUSE_LENGTH = 160


@dataclass
class Failure:
    job_id: str
    partition: str
    line: str  # the failure's own line: the exception and its message
    cause: str
    worker: str = ""  # the worker that failed it, as RQ recorded


# What to do about the causes with a known remedy, by a piece of their text.
FIXES = (
    (
        ("DeserializationError", "run only in worker.FleetWorker"),
        "a plain RQ worker took these jobs: start workers with `rq worker -w worker.FleetWorker short long`"
        " (or `python -m worker`), then `python -m producer retry-failed`",
    ),
    (
        ("HTTP 400",),
        "the server refused the request itself (a prompt too long, a sampling parameter): fix the partition or"
        " the settings, then `python -m producer retry-failed`",
    ),
    (
        ("CrashesTheServer",),
        "the server went down each time this prompt ran alone on it: look at the prompt (and the server's log);"
        " `retry-failed` would crash the server again",
    ),
    (
        ("ServerDown",),
        "a plain RQ worker's job in flight through FLEET_MAX_SERVER_FAILURES server crashes: it may be what"
        " crashes the server; look at the prompt before `retry-failed`",
    ),
    (
        ("PromptMissing",),
        "the prompt's ids are not in this worker's output store: give every host the same FLEET_OUTPUT_DIR,"
        " then `python -m producer retry-failed`",
    ),
    (("Refused:",), "not a job the producer made: delete it from the failed registry"),
)


def fix_for(cause: str) -> str | None:
    return next((fix for pieces, fix in FIXES if any(piece in cause for piece in pieces)), None)


def read_failures(connection: Redis, partition_of: dict[str, str]) -> list[Failure]:
    """The latest failure of each job in `partition_of` (job ID -> partition), one pipelined round trip."""
    job_ids = sorted(partition_of)
    with connection.pipeline(transaction=False) as pipeline:
        for job_id in job_ids:
            pipeline.xrevrange(Result.get_key(job_id), "+", "-", count=1)
        replies = pipeline.execute()
    failures = []
    for job_id, reply in zip(job_ids, replies, strict=True):
        text, worker = _exc_string(connection, job_id, reply[0]) if reply else ("", "")
        line = failure_line(text) or "no failure recorded"
        failures.append(Failure(job_id, partition_of[job_id], line, cause_of(line), worker))
    return failures


def _exc_string(connection: Redis, job_id: str, entry: tuple[bytes, dict[bytes, bytes]]) -> tuple[str, str]:
    """The failure text of one entry of a job's RQ results stream, and the worker that recorded it.

    Whoever can write to Redis can forge these entries: `return_value` is left out before RQ reads
    the entry (RQ would unpickle it by default, and this needs only `exc_string`), and JSON is the
    serializer should anything else be decoded. An entry that cannot be read is reported, not raised.
    """
    result_id, payload = entry
    payload = {key: value for key, value in payload.items() if key != b"return_value"}
    try:
        result = Result.restore(job_id, result_id.decode(), payload, connection=connection, serializer=PlainPickle)
    except (ValueError, KeyError, zlib.error) as error:
        return f"unreadable failure record: {type(error).__name__}", ""
    return result.exc_string or "", result.worker_name or ""


def failure_line(text: str) -> str:
    """The line that says what went wrong: a traceback's last unindented line, else the first line."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].startswith("Traceback"):
        return next(line for line in reversed(lines) if not line[0].isspace())
    return lines[0]


def cause_of(line: str) -> str:
    """The failure line without what varies between alike failures: the module path, URLs, numbers.

    `worker.sglang.PermanentError: http://h:1: HTTP 400: (80 tokens)` -> `PermanentError: HTTP 400: (N tokens)`
    """
    name, separator, message = line.partition(": ")
    if separator and _CLASS.fullmatch(name):
        prefix = name.rsplit(".", 1)[-1] + ": "
    else:
        prefix, message = "", line
    message = _URL.sub("<url>", _URL_THEN_COLON.sub("", message))
    cause = prefix + _NUMBER.sub("N", message)
    return cause if len(cause) <= CAUSE_LENGTH else cause[: CAUSE_LENGTH - 3] + "..."


def group_by_cause(failures: Iterable[Failure]) -> list[tuple[str, list[Failure]]]:
    """Causes with their failures, the most frequent first."""
    groups: dict[str, list[Failure]] = {}
    for failure in failures:
        groups.setdefault(failure.cause, []).append(failure)
    return sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))


def matches(failure: Failure, cause: str | None) -> bool:
    """Whether `cause` (any part of the cause or of the failure line, case aside) names this failure."""
    if cause is None:
        return True
    wanted = cause.lower()
    return wanted in failure.cause.lower() or wanted in failure.line.lower()
