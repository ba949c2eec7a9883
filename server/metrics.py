"""What the supervisor reads in SGLang's log (decode statistics, out-of-memory crashes) and where it puts it.

SGLang's scheduler logs a decode line every `--decode-log-interval` steps (managers/scheduler_components/
metrics_reporter.py in 0.5.23; older versions write `Decode batch.` where newer ones write `Decode batch,`):

    [2026-01-01 12:00:00 TP0] Decode batch, #running-req: 7, #token: 5120, token usage: 0.03,
    cuda graph: True, gen throughput (token/s): 931.52, #queue-req: 2

The latest line's figures go to the Redis hash `server_metrics_key(url)` for status tooling, with the
supervisor's own view of the server (state, pid, restarts, mem_fraction_static).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import redis

from common.protocol.keys import server_metrics_key
from common.records import ServerMetrics, figure

_DECODE = re.compile(r"Decode batch(?: \[\d+\])?[.,] (?P<fields>#running-req: .*)")
# The figures kept, by their label in the log; others (speculative decoding, disaggregation) are skipped.
_FIELDS = {
    "#running-req": "running_req",
    "#token": "token",
    "token usage": "token_usage",
    "cuda graph": "cuda_graph",
    "gen throughput (token/s)": "gen_throughput",
    "#queue-req": "queue_req",
}
# PyTorch's allocator, the CUDA runtime and NCCL say it in these ways, and SGLang when a TP rank finds too
# little host memory for its hierarchical cache (mem_cache/pool_host/base.py: later ranks count the memory
# earlier ones pinned). Not SGLang's "Not enough memory. Please try to increase --mem-fraction-static",
# which asks for the opposite change.
_OUT_OF_MEMORY = re.compile(
    r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation"
    r"|Not enough host memory available"
)


# A hybrid model (sliding-window or Mamba layers, HiSparse) logs a count and a usage per pool instead
# (scheduler_components/pool_stats_observer.py): the full pool's count stands for #token, and the fullest
# pool's usage for token usage, as SGLang's own sglang:token_usage gauge takes it.
_HYBRID_COUNTS = ("#full token", "#gpu token")
_HYBRID_USAGES = ("full token usage", "swa token usage", "mamba usage", "gpu token usage")


def parse_decode(line: str) -> dict[str, str] | None:
    """The figures of a decode log line, or None for any other line."""
    match = _DECODE.search(line)
    if match is None:
        return None
    found = {}
    for part in match["fields"].split(", "):
        label, _, value = part.partition(": ")
        found[label] = value.strip().rstrip(",")
    fields = {_FIELDS[label]: value for label, value in found.items() if label in _FIELDS}
    if "token" not in fields and (count := next((found[label] for label in _HYBRID_COUNTS if label in found), None)):
        fields["token"] = count
    usages = [usage for label in _HYBRID_USAGES if (usage := figure(found.get(label))) is not None]
    if "token_usage" not in fields and usages:
        fields["token_usage"] = f"{max(usages):.2f}"
    return fields


def is_out_of_memory(line: str) -> bool:
    return _OUT_OF_MEMORY.search(line) is not None


class LogFollower:
    """The lines appended to a log file since this follower was made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.partial = b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as log:
                log.seek(self.offset)
                data = log.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        return [line.decode(errors="replace") for line in complete]


class MetricsHash:
    """The Redis hash of one server. Redis being away costs the metrics, never the supervision."""

    def __init__(self, client: redis.Redis, url: str, say: Callable[[str], None]) -> None:
        self.client = client
        self.key = server_metrics_key(url)
        self.say = say
        self.failing = False

    def decode(self, fields: dict[str, str]) -> None:
        self._write(ServerMetrics.parse({**fields, "updated_at": time.time()}))

    def state(self, state: str, **fields: str | int | float) -> None:
        self._write(ServerMetrics.parse({"state": state, "state_at": time.time(), **fields}))

    def _write(self, metrics: ServerMetrics) -> None:
        try:
            self.client.hset(self.key, mapping=metrics.to_hash())
        except redis.RedisError as error:
            if not self.failing:
                self.say(f"cannot store server metrics in Redis: {error}")
            self.failing = True
        else:
            self.failing = False
