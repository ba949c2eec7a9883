"""The simulator's HTTP endpoints: SGLang's native API over the simulated engine, with fault flags.

Shapes follow SGLang 0.5.23 (`pip download sglang`; paths under python/sglang/srt/ unless noted):
- entrypoints/http_server.py: routes; `/health_generate` answers 200 as soon as the engine produces
  anything; a ValueError is answered `400 {"error": {"message": ...}}`, a malformed body
  `400 {"object": "error", "message", "type", "param", "code"}`.
- managers/tokenizer_manager.py: `meta_info`; schedule_batch.py: the finish reasons (an abort with no
  status code is answered 200 with the partial output).
- utils/auth.py: `--api-key` wants `Authorization: Bearer KEY`, else `401 {"error": "Unauthorized"}`,
  and leaves /health*, /ready and /metrics open (and here /sim/stats).
- observability/metrics_collector.py: metric names and labels.
Differences: /health answers at once (SGLang 0.5.23 also generates a token there unless
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0), and streaming, `n` > 1, `stop` strings, logprobs and the
OpenAI-compatible routes are not simulated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import random
import time
from collections import Counter
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from server.simulator.contract import Prompt, Refused, check_length, parse_generate
from server.simulator.engine import Model, Scheduler

log = logging.getLogger("server.simulator")

# SGLang's metrics and their help texts: the scheduler's gauges, the tokenizer manager's counters.
GAUGES = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "token_usage": "The token usage.",
    "gen_throughput": "The generation throughput (token/s).",
}
COUNTERS = {
    "prompt_tokens": "Number of prefill tokens processed.",
    "generation_tokens": "Number of generation tokens processed.",
    "num_requests": "Number of requests processed.",
}
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics", "/sim/")  # no API key needed, as in SGLang (+ ours)
EXIT_GRACE_SECONDS = 0.1  # lets the last answer leave the process's buffers before it dies


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def input_digest(input_ids: list[int]) -> str:
    return hashlib.sha1(orjson.dumps(input_ids)).hexdigest()


async def until_disconnected(request: Request) -> None:
    """Return once the client has gone: the body is read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Simulator:
    """The HTTP endpoints and the state behind them."""

    def __init__(self, args: argparse.Namespace, model: Model) -> None:
        self.args = args
        self.model = model
        self.model_name: str = args.served_model_name or args.model_path
        self.scheduler = Scheduler(args.max_running)
        # Faults draw from their own stream, so a retried prompt is not doomed to fail the same way again.
        self.faults = random.Random(args.seed)
        self.stats: Counter[str] = Counter()
        self.inputs: Counter[str] = Counter()
        self.used_tokens = 0
        self.exiting = False
        self.crashing: asyncio.Future[None] | None = None
        self.started = time.time()

    def app(self) -> Starlette:
        routes = [
            Route("/generate", self.generate, methods=["POST", "PUT"]),
            Route("/health", self.health),
            Route("/health_generate", self.health_generate),
            Route("/server_info", self.server_info),
            Route("/get_server_info", self.server_info),
            Route("/model_info", self.model_info),
            Route("/get_model_info", self.model_info),
            Route("/metrics", self.metrics),
            Route("/sim/stats", self.sim_stats),
        ]
        middleware = [Middleware(ApiKeyMiddleware, api_key=self.args.api_key)] if self.args.api_key else []
        return Starlette(routes=routes, middleware=middleware)

    async def generate(self, request: Request) -> Response:
        arrived = time.perf_counter()
        self.stats["requests"] += 1
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as error:
            self.stats["errors"] += 1
            message = f"JSON decode error: {error}"
            content = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
            return JSONResponse(content, status_code=400)
        if self.faults.random() < self.args.error_rate:
            self.stats["errors"] += 1
            status = self.args.error_status
            message = f"Simulated refusal (--error-rate, --error-status {status})"
            content = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
            headers = {"Retry-After": f"{self.args.retry_after:g}"} if self.args.retry_after is not None else None
            return JSONResponse(content, status_code=status, headers=headers)
        try:
            prompts, single = parse_generate(body, self.model.encode)
            for prompt in prompts:
                check_length(prompt, self.args.context_length)
        except Refused as refused:
            self.stats["errors"] += 1
            return JSONResponse(refused.body, status_code=400)
        self.inputs.update(input_digest(prompt.input_ids) for prompt in prompts)
        poison = self.args.crash_on_token
        if poison is not None and not self.exiting and any(poison in prompt.input_ids for prompt in prompts):
            # As a server that a prompt crashes: it takes the prompt in, then dies with everything in flight.
            self.exiting = True
            self.crashing = asyncio.ensure_future(self.crash(f"a prompt holds token {poison} (--crash-on-token)"))
        if self.args.hang:
            await until_disconnected(request)
            return Response()

        work = asyncio.ensure_future(asyncio.gather(*(self.run_prompt(prompt, arrived) for prompt in prompts)))
        gone = asyncio.ensure_future(until_disconnected(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # SGLang aborts what a vanished client asked for; so do we, freeing its slots
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            self.stats["disconnected"] += 1
            return Response()
        gone.cancel()

        if self.exiting:  # the process is about to die: later answers are lost with it
            await until_disconnected(request)
            return Response()
        self.stats["completed"] += 1
        crash = None
        if self.args.exit_after is not None and self.stats["completed"] >= self.args.exit_after:
            self.exiting = True
            crash = BackgroundTask(self.crash, f"--exit-after {self.args.exit_after} reached")
        outputs = work.result()
        return JSONResponse(outputs[0] if single else outputs, background=crash)

    async def run_prompt(self, prompt: Prompt, arrived: float) -> dict[str, Any]:
        generation = self.model.generate(prompt)
        output_ids, finish_reason, text = generation.output_ids, generation.finish_reason, generation.text
        if self.faults.random() < self.args.abort_rate:
            output_ids = output_ids[: len(output_ids) // 2]
            finish_reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            text = self.model.text(output_ids, finish_reason, prompt.params)
            self.stats["aborted"] += 1
        prompt_tokens = len(prompt.input_ids)
        seconds = self.args.prefill_latency * prompt_tokens / 1000 + self.args.token_latency * len(output_ids)
        async with self.scheduler.slot():
            self.used_tokens += prompt_tokens + len(output_ids)
            try:
                await asyncio.sleep(seconds)
            finally:
                self.used_tokens -= prompt_tokens + len(output_ids)
        self.stats["prompt_tokens"] += prompt_tokens
        self.stats["generation_tokens"] += len(output_ids)
        self.stats["num_requests"] += 1
        return {
            "text": text,
            "output_ids": output_ids,
            "meta_info": {
                "id": prompt.rid,
                "finish_reason": finish_reason,
                "prompt_tokens": prompt_tokens,
                "weight_version": "default",
                "num_retractions": 0,
                "reasoning_tokens": 0,
                "completion_tokens": len(output_ids),
                "cached_tokens": 0,
                "e2e_latency": time.perf_counter() - arrived,
                "response_sent_to_client_ts": time.time(),
            },
        }

    async def crash(self, reason: str) -> None:
        await asyncio.sleep(EXIT_GRACE_SECONDS)
        log.warning("%s: exiting abruptly, dropping open connections", reason)
        os._exit(1)

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        if self.args.hang:
            await until_disconnected(request)
            return Response()
        # SGLang is healthy once anything comes out of the engine; when idle, it generates one token itself.
        if not self.scheduler.running:
            async with self.scheduler.slot():
                await asyncio.sleep(self.args.token_latency)
        return Response(status_code=200)

    async def server_info(self, request: Request) -> Response:
        args = self.args
        return JSONResponse(
            {
                "model_path": args.model_path,
                "tokenizer_path": args.tokenizer_path,
                "served_model_name": self.model_name,
                "host": args.host,
                "port": args.port,
                "context_length": args.context_length,
                "max_running_requests": args.max_running,
                "max_total_tokens": args.max_total_tokens,
                "random_seed": args.seed,
                "enable_metrics": True,
                "weight_version": "default",
                "status": "ready",
                "max_total_num_tokens": args.max_total_tokens,
                "max_req_input_len": args.context_length - 1,
                "startup_time": self.started,
                "internal_states": [
                    {
                        "effective_max_running_requests_per_dp": args.max_running,
                        "last_gen_throughput": self.gen_throughput(),
                    }
                ],
                "version": "simulator",
                "frontend": "simulator",
            }
        )

    async def model_info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self.args.model_path,
                "served_model_name": self.model_name,
                "tokenizer_path": self.args.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "simulator",
                "architectures": ["SimulatorForCausalLM"],
            }
        )

    def gen_throughput(self) -> float:
        """Tokens per second the running requests produce under the latency model."""
        return self.scheduler.running / self.args.token_latency if self.args.token_latency > 0 else 0.0

    async def metrics(self, request: Request) -> Response:
        gauge_labels = f'model_name="{self.model_name}",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
        counter_labels = f'model_name="{self.model_name}",engine_type="unified",is_streaming="false"'
        values = {
            "num_running_reqs": self.scheduler.running,
            "num_queue_reqs": self.scheduler.queued,
            "token_usage": self.used_tokens / self.args.max_total_tokens,
            "gen_throughput": self.gen_throughput(),
        }
        lines = []
        for name, help_text in GAUGES.items():
            lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} gauge"]
            lines.append(f"sglang:{name}{{{gauge_labels}}} {float(values[name])}")
        for name, help_text in COUNTERS.items():
            lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} counter"]
            lines.append(f"sglang:{name}_total{{{counter_labels}}} {float(self.stats[name])}")
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")

    async def sim_stats(self, request: Request) -> Response:
        """For tests: `requests`, `completed`, `errors` and `disconnected` count /generate calls (a batch is
        one); `aborted`, `running`, `queued`, the peaks and `inputs` (sha1 of the input ids as JSON: times
        asked) count prompts."""
        return JSONResponse(
            {
                "requests": self.stats["requests"],
                "completed": self.stats["completed"],
                "aborted": self.stats["aborted"],
                "errors": self.stats["errors"],
                "disconnected": self.stats["disconnected"],
                "running": self.scheduler.running,
                "queued": self.scheduler.queued,
                "peak_running": self.scheduler.peak_running,
                "peak_in_flight": self.scheduler.peak_in_flight,
                "inputs": dict(self.inputs),
            }
        )


class ApiKeyMiddleware:
    """SGLang's --api-key check (utils/auth.py) for its ordinary endpoints."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and not self.allowed(scope):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def allowed(self, scope: Scope) -> bool:
        if scope["path"].startswith(OPEN_PATH_PREFIXES):
            return True
        scheme, _, token = (Headers(scope=scope).get("authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and token == self.api_key
