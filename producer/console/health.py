"""The SGLang servers: asked directly whether they answer, with their load from the supervisor or from SGLang.

A crashed server and a healthy idle one both log nothing, so health is never inferred from
metrics: each server is asked on `/health`, and its load is shown beside the answer.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from redis import Redis

from common.protocol.keys import server_metrics_key
from common.records import ServerMetrics, figure
from common.settings import Settings

# SGLang's /health runs the same check as /health_generate, which sleeps about a second, may generate a
# token, and gives up after SGLANG_HEALTH_CHECK_TIMEOUT (20 s; entrypoints/http_server.py): a loaded server
# answers within that, so the wait is a little longer. Servers are asked side by side.
HEALTH_TIMEOUT = 25.0
# Its Prometheus gauges answer at once.
TIMEOUT = 2.0
# Decode lines stop when a server idles, so the supervisor's figures go stale: then SGLang's own gauges are asked.
FRESH_FOR = 30.0
# SGLang's Prometheus gauges and the supervisor's names for the same figures (server/metrics.py).
GAUGES = {
    "sglang:num_running_reqs": "running_req",
    "sglang:num_queue_reqs": "queue_req",
    "sglang:token_usage": "token_usage",
    "sglang:gen_throughput": "gen_throughput",
}
# Summed over the label sets of several ranks, except usage, a fraction of each rank's cache.
_BUSIEST = {"token_usage"}


@dataclass
class ServerView:
    url: str
    health: str = "unknown"  # healthy, unhealthy, unresponsive or down
    detail: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    metrics_from: str | None = None  # "supervisor" (the log's decode lines) or "prometheus"
    metrics_age_s: float | None = None
    supervisor: dict[str, str] = field(default_factory=dict)
    # What the workers see: their requests in flight there, and which of them find it down.
    workers_in_flight: int = 0
    down_for_workers: list[str] = field(default_factory=list)


def server_urls(connection: Redis, settings: Settings, worker_servers: list[dict[str, Any]]) -> list[str]:
    """The configured servers, those the workers use, and those a supervisor reports on."""
    urls = dict.fromkeys(settings.sglang_url)
    urls.update(dict.fromkeys(server["url"] for server in worker_servers))
    prefix = server_metrics_key("")
    urls.update(dict.fromkeys(key.decode().removeprefix(prefix) for key in connection.scan_iter(match=prefix + "*")))
    return list(urls)


def inspect_servers(connection: Redis, urls: list[str], now: float) -> list[ServerView]:
    with connection.pipeline(transaction=False) as pipeline:
        for url in urls:
            pipeline.hgetall(server_metrics_key(url))
        hashes = [ServerMetrics.from_hash(raw) for raw in pipeline.execute()]
    # Asked side by side: a hung server costs the whole screen HEALTH_TIMEOUT seconds, not that each.
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda url, stored: _inspect(url, stored, now), urls, hashes))


def _inspect(url: str, stored: ServerMetrics, now: float) -> ServerView:
    view = ServerView(url)
    with httpx.Client(timeout=TIMEOUT) as client:
        view.health, view.detail = _health(client, url)
        scraped = _scrape(client, url) if view.health == "healthy" else {}
    supervisor = stored.model_dump(include={"state", "reason", "restarts", "pid"})
    view.supervisor = {key: str(value) for key, value in supervisor.items() if value not in (None, "")}
    updated_at = stored.updated_at or 0.0
    logged = {name: value for name in GAUGES.values() if (value := getattr(stored, name)) is not None}
    if logged and now - updated_at <= FRESH_FOR:
        view.metrics, view.metrics_from, view.metrics_age_s = logged, "supervisor", max(0.0, now - updated_at)
    elif scraped:
        view.metrics, view.metrics_from, view.metrics_age_s = scraped, "prometheus", 0.0
    elif logged:
        view.metrics, view.metrics_from, view.metrics_age_s = logged, "supervisor", max(0.0, now - updated_at)
    return view


def _health(client: httpx.Client, url: str) -> tuple[str, str]:
    started = time.monotonic()
    try:
        response = client.get(f"{url}/health", timeout=HEALTH_TIMEOUT)
    except httpx.ConnectError as error:
        return "down", f"cannot connect: {error}"
    except httpx.TimeoutException:
        return "unresponsive", f"no answer on /health within {HEALTH_TIMEOUT:g}s"
    except httpx.HTTPError as error:
        return "down", f"{type(error).__name__}: {error}"
    if response.status_code != 200:
        return "unhealthy", f"/health answered HTTP {response.status_code}"
    return "healthy", f"/health answered in {time.monotonic() - started:.2f}s"


def _scrape(client: httpx.Client, url: str) -> dict[str, float]:
    """SGLang's gauges from `/metrics` (served with --enable-metrics), or nothing."""
    try:
        response = client.get(f"{url}/metrics")
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    figures: dict[str, float] = {}
    for line in response.text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = GAUGES.get(name_and_labels.split("{", 1)[0])
        number = figure(value)
        if name is None or number is None:
            continue
        combine = max if name in _BUSIEST else sum
        figures[name] = combine((figures.get(name, 0.0), number))
    return figures
