"""A client for SGLang's native `/generate` over one or more servers, with health tracking.

Each request goes to the healthy server with the fewest requests in flight from this process. A
server that refuses or drops connections is marked down and probed on `/health_generate` until it
answers again; while no server is up, callers wait instead of spending their retries. A request turned
away (SGLang's per-request 503, a router's 429 or 408, a proxy's 502 or 504) says nothing of the
server's health: it is `Busy`, sent again after a pause.

It uses aiohttp rather than httpx: with 182 connections open, httpx's pool spent about 18 ms of CPU
per request against the simulator, aiohttp 0.4 ms (bench/fleet.py shows the worker-level figure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from pydantic import BaseModel, ValidationError

from common.settings import Settings

log = logging.getLogger(__name__)

PROBE_INTERVAL = 0.5
PROBE_TIMEOUT = 30.0
# Below uvicorn's 5 s keep-alive (SGLang's server): never reuse a connection the server is closing.
KEEPALIVE_TIMEOUT = 4.0
JSON_HEADERS = {"Content-Type": "application/json"}


class GenerationError(Exception):
    """A generation that did not produce an output."""


class PermanentError(GenerationError):
    """The server refused the request itself (HTTP 4xx): retrying cannot help."""


class TransientError(GenerationError):
    """The request failed but may succeed if sent again (an aborted generation, a 5xx)."""


class Unauthorized(GenerationError):
    """The server refused our API key (HTTP 401 or 403): no request can succeed until the settings change."""


class Busy(GenerationError):
    """The server, or a router in front of it, turned this request away for now: HTTP 429 or 408 (a router's
    queue full or timed out), 502 or 504 (a proxy), or SGLang's own 503, which in 0.5.23 only ever refuses one
    request (--max-queued-requests full, a queue timeout, preemption) and says nothing of the server's health.
    Sent again after a pause, spending none of the job's attempts."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# Statuses that turn a request away without judging it: routers (sglang-router, proxies) and SGLang's queue.
BUSY_STATUSES = {408, 429, 502, 503, 504}


class ServerDown(GenerationError):
    """The server cannot take requests now; wait for its health instead of counting a retry."""


class MetaInfo(BaseModel):
    finish_reason: dict[str, Any]
    # Absent when SGLang aborts a request still waiting in its queue.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Generated(BaseModel):
    """The fields of SGLang's `/generate` answer that the fleet keeps."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    server: str = ""
    model: str = ""
    server_version: str = ""


@dataclass
class Server:
    url: str
    # The served model's path and SGLang's version, as `/model_info` and `/server_info` say: recorded
    # with every output, so that a dataset made by two models or versions can be told apart.
    model: str = ""
    version: str = ""
    healthy: bool = False
    # Why the last probe failed (connection refused, an HTTP status), while the server is down.
    problem: str = "not probed yet"
    probed: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0
    down_since: float | None = field(default_factory=time.time)


class SGLangClient:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.servers = [Server(url) for url in settings.sglang_url]
        self.any_healthy = asyncio.Event()
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self, probe: bool = True) -> None:
        """Open the connection pool and begin probing every server; `any_healthy` is set once one answers.

        Without `probe` (one generation in a plain RQ worker's horse) the servers are taken as healthy until
        a request finds one down: SGLang's /health_generate generates a token of its own each time.
        """
        headers = {}
        if self.settings.sglang_api_key is not None:
            headers["Authorization"] = f"Bearer {self.settings.sglang_api_key.get_secret_value()}"
        # No total timeout: a healthy generation of 16K tokens can take many minutes.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.settings.connect_timeout)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_TIMEOUT)
        self._session = aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout)
        for server in self.servers:
            if probe:
                self._mark_down(server)
            else:
                await self._describe(server)
                self._set_healthy(server)

    async def all_probed(self) -> None:
        """Return once every server has answered, or failed, its first probe."""
        await asyncio.gather(*(server.probed.wait() for server in self.servers))

    async def close(self) -> None:
        for probe in self._probes.values():
            probe.cancel()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "SGLangClient.start() was not called"
        return self._session

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Generated:
        server = await self._pick()
        payload = orjson.dumps({"input_ids": input_ids, "sampling_params": sampling_params})
        server.in_flight += 1
        try:
            async with self.session.post(f"{server.url}/generate", data=payload, headers=JSON_HEADERS) as response:
                status, body = response.status, await response.read()
                retry_after = _seconds(response.headers.get("Retry-After"))
        except (aiohttp.ClientError, TimeoutError) as error:
            self._mark_down(server)
            raise ServerDown(f"{server.url}: {type(error).__name__}: {error}") from error
        finally:
            server.in_flight -= 1
        return self._parse(server, status, body, retry_after)

    def _parse(self, server: Server, status: int, body: bytes, retry_after: float | None = None) -> Generated:
        text = body[:500].decode(errors="replace")
        if status in BUSY_STATUSES:
            raise Busy(f"{server.url}: HTTP {status}: {text}", retry_after)
        if status in (401, 403):
            raise Unauthorized(f"{server.url}: HTTP {status}: {text}")
        if 400 <= status < 500:
            raise PermanentError(f"{server.url}: HTTP {status}: {text}")
        if status != 200:
            raise TransientError(f"{server.url}: HTTP {status}: {text}")
        try:
            generated = Generated.model_validate_json(body)
        except ValidationError as error:
            raise TransientError(f"{server.url}: unexpected answer: {error}") from error
        generated.server = server.url
        generated.model = server.model
        generated.server_version = server.version
        reason = generated.meta_info.finish_reason.get("type")
        if reason not in ("stop", "length"):
            message = generated.meta_info.finish_reason.get("message", "")
            raise TransientError(f"{server.url}: generation ended with {reason!r}: {message}")
        return generated

    async def _pick(self) -> Server:
        while True:
            healthy = [server for server in self.servers if server.healthy]
            if healthy:
                return min(healthy, key=lambda server: server.in_flight)
            await self.any_healthy.wait()

    def _mark_down(self, server: Server) -> None:
        if server.url in self._probes:
            return
        if server.healthy:
            log.warning("server %s is down; waiting for /health_generate", server.url)
            server.down_since = time.time()
        server.healthy = False
        if not any(other.healthy for other in self.servers):
            self.any_healthy.clear()
        self._probes[server.url] = asyncio.create_task(self._probe(server))

    async def _info(self, server: Server, name: str) -> dict[str, Any]:
        # SGLang 0.5.23 serves /model_info and /server_info, and their deprecated names /get_model_info and
        # /get_server_info, which are all sglang-router serves.
        for path in (f"/{name}", f"/get_{name}"):
            try:
                async with self.session.get(f"{server.url}{path}") as response:
                    info = orjson.loads(await response.read()) if response.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
                return {}
            if isinstance(info, dict):
                return info
        return {}

    async def _probe(self, server: Server) -> None:
        """Poll `/health_generate` until the server can generate again."""
        while True:
            try:
                timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT)
                async with self.session.get(f"{server.url}/health_generate", timeout=timeout) as response:
                    if response.status == 200:
                        break
                    server.problem = f"/health_generate answered HTTP {response.status}"
            except TimeoutError:
                server.problem = f"no answer on /health_generate within {PROBE_TIMEOUT:g}s"
            except aiohttp.ClientError as error:
                server.problem = f"{type(error).__name__}: {error}"
            server.probed.set()
            await asyncio.sleep(PROBE_INTERVAL)
        await self._describe(server)
        log.info("server %s (SGLang %s) is healthy, serving %s", server.url, server.version, server.model)
        del self._probes[server.url]
        self._set_healthy(server)

    async def _describe(self, server: Server) -> None:
        """What the server says of its model and version, recorded with every output."""
        server.model = str((await self._info(server, "model_info")).get("model_path", ""))
        # Behind sglang-router, the router's own info, which has no version.
        server.version = str((await self._info(server, "server_info")).get("version", ""))

    def _set_healthy(self, server: Server) -> None:
        server.healthy = True
        server.problem = ""
        server.probed.set()
        server.down_since = None
        self.any_healthy.set()


def _seconds(retry_after: str | None) -> float | None:
    """A Retry-After header given in seconds (the HTTP-date form is rare from routers: it is ignored)."""
    try:
        return max(0.0, float(retry_after)) if retry_after is not None else None
    except ValueError:
        return None
