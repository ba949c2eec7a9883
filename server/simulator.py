"""Simulate an SGLang server's HTTP API for tests and dry runs (never a real server).

It answers the native endpoints the fleet uses, with SGLang's request and response shapes, and makes up
the generations: output ids are a deterministic function of the prompt, the sampling params and --seed,
so a prompt run twice gives the same answer, and the time a request takes follows a simple latency
model behind a cap on running requests, like SGLang's --max-running-requests with its first-come,
first-served queue. Fault flags make it crash, abort, fail or hang on purpose.

Shapes follow SGLang 0.5.23 (`pip download sglang`; paths under python/sglang/srt/ unless noted):
- entrypoints/http_server.py: routes; `/health_generate` answers 200 as soon as the engine produces
  anything; a ValueError is answered `400 {"error": {"message": ...}}`, a malformed body
  `400 {"object": "error", "message", "type", "param", "code"}`.
- entrypoints/api_contract.py and python/sglang/api/v1/api_types.py: the contract gate refuses an unknown or mistyped
  sampling key with `400 {"error": "unknown field `max_tokens`, expected one of ..."}` (a string).
- managers/io_struct.py (GenerateReqInput): single or batch form, `text` winning over `input_ids`.
- sampling/sampling_params.py: the keys, max_new_tokens 128, verify()'s messages.
- managers/tokenizer_manager.py: the context-length checks, `meta_info`; schedule_batch.py: the
  finish reasons (an abort with no status code is answered 200 with the partial output).
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
import uuid
import zlib
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("server.simulator")

# SamplingParams' keys, in the order SGLang lists them when it refuses an unknown one.
SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
# The JSON type of each scalar key, named as SGLang's schema gate names it in its refusals.
SCALAR_TYPES = {
    **dict.fromkeys(
        ["max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval", "sampling_seed", "beam_width"], "i64"
    ),
    **dict.fromkeys(
        ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"], "f64"
    ),
    **dict.fromkeys(
        ["ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"], "a boolean"
    ),
}
# Keys that only cut the output short or change how it is shown: they leave the sampled tokens alone,
# so max_new_tokens=8 gives the first 8 tokens of the max_new_tokens=100 answer, as greedy decoding would.
SHAPING_KEYS = {
    "max_new_tokens",
    "min_new_tokens",
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
}
# Defaults of the keys that pick tokens, so {} and {"temperature": 1.0} sample alike.
SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
DEFAULT_MAX_NEW_TOKENS = 128
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
FIRST_WORD_ID = 3  # ids below are special tokens, like most tokenizers' pad/bos/eos
SYLLABLES = [consonant + vowel for consonant in "bdfgklmnprstvz" for vowel in "aeiou"]
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics", "/sim/")  # no API key needed, as in SGLang (+ ours)
EXIT_GRACE_SECONDS = 0.1  # lets the last answer leave the process's buffers before it dies


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class Refused(Exception):
    """A request SGLang turns down with a 400; `body` is what it answers."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.body = body


def contract_error(message: str) -> Refused:
    """The schema gate's refusal: the error is a bare string."""
    return Refused({"error": message})


def value_error(message: str) -> Refused:
    """A ValueError from the tokenizer manager or SamplingParams.verify()."""
    return Refused({"error": {"message": message}})


def describe(value: Any) -> str:
    """A JSON value as serde's `Unexpected` shows it, which SGLang's schema gate copies."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def has_type(value: Any, expected: str) -> bool:
    if expected == "a boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if expected == "i64" else isinstance(value, int | float)


def invalid_type(value: Any, expected: str) -> Refused:
    return contract_error(f"invalid type: {describe(value)}, expected {expected}")


def check_sampling_params(params: Any) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise invalid_type(params, "struct SamplingParams")
    for key, value in params.items():
        if key not in SAMPLING_KEYS:
            expected = ", ".join(f"`{name}`" for name in SAMPLING_KEYS)
            raise contract_error(f"unknown field `{key}`, expected one of {expected}")
        if value is None:
            continue  # null means the default
        if key in SCALAR_TYPES and not has_type(value, SCALAR_TYPES[key]):
            raise invalid_type(value, SCALAR_TYPES[key])
        if key == "stop_token_ids":
            if not isinstance(value, list):
                raise invalid_type(value, "a sequence")
            for token in value:
                if not has_type(token, "i64"):
                    raise invalid_type(token, "i64")
    return params


def verify_sampling_params(params: dict[str, Any]) -> None:
    """The checks of SGLang's SamplingParams.verify() for the keys the simulation reads."""
    temperature = params.get("temperature")
    if temperature is not None and temperature < 0:
        raise value_error(f"temperature must be a non-negative finite number, got {float(temperature)}.")
    top_p = params.get("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise value_error(f"top_p must be in (0, 1], got {float(top_p)}.")
    min_new = params.get("min_new_tokens") or 0
    if min_new < 0:
        raise value_error(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is not None and max_new < 0:
        raise value_error(f"max_new_tokens must be at least 0, got {max_new}.")
    if max_new is not None and min_new > max_new:
        raise value_error(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    if (params.get("n") or 1) != 1:
        raise value_error("The SGLang simulator does not support n > 1.")


@dataclass
class Prompt:
    rid: str
    input_ids: list[int]
    params: dict[str, Any]


def parse_generate(body: Any, vocab_size: int) -> tuple[list[Prompt], bool]:
    """The prompts of a /generate body and whether it was the single form, or Refused."""
    if not isinstance(body, dict):
        raise invalid_type(body, "struct GenerateRequest")
    if body.get("stream"):
        raise value_error("The SGLang simulator does not stream; send stream=false.")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None:
        if not isinstance(text, str | list):
            raise invalid_type(text, "a value or an array of values for StringOrList")
        single = isinstance(text, str)
        for item in [] if single else text:
            if not isinstance(item, str):
                raise invalid_type(item, "a string")
        batch = [tokenize(item, vocab_size) for item in ([text] if single else text)]
    elif input_ids is not None:
        if not isinstance(input_ids, list):
            raise invalid_type(input_ids, "a value or an array of values for TokenIdsOrList")
        if not input_ids:
            raise value_error("input_ids cannot be empty.")
        single = not isinstance(input_ids[0], list)
        batch = [input_ids] if single else input_ids
        for ids in batch:
            if not isinstance(ids, list):
                raise invalid_type(ids, "a sequence")
            for token in ids:
                if not has_type(token, "i64"):
                    raise invalid_type(token, "i64")
    else:
        raise value_error("Either text, input_ids or input_embeds should be provided.")

    params = body.get("sampling_params") or {}
    if isinstance(params, list):
        param_list = [check_sampling_params(item) for item in params]
        if len(param_list) != len(batch):
            raise value_error("The length of sampling_params should be equal to the batch size.")
    else:
        param_list = [check_sampling_params(params)] * len(batch)
    for item in param_list:
        verify_sampling_params(item)

    rid = body.get("rid")
    if single:
        rids = [rid if isinstance(rid, str) else uuid.uuid4().hex]
    elif isinstance(rid, list):
        if len(rid) != len(batch):
            raise value_error("The specified rids length mismatch with the batch_size for batch processing.")
        rids = [str(item) for item in rid]
    else:
        rids = [f"{rid}_{i}" if isinstance(rid, str) else uuid.uuid4().hex for i in range(len(batch))]
    return [Prompt(*fields) for fields in zip(rids, batch, param_list, strict=True)], single


def tokenize(text: str, vocab_size: int) -> list[int]:
    """One made-up token per whitespace-separated word: stable, so a text prompt is as deterministic as ids."""
    return [FIRST_WORD_ID + zlib.crc32(word.encode()) % (vocab_size - FIRST_WORD_ID) for word in text.split()]


def word(token_id: int) -> str:
    """A pronounceable word per token id, so simulated text reads like text and differs when ids do."""
    syllables = []
    while True:
        token_id, digit = divmod(token_id, len(SYLLABLES))
        syllables.append(SYLLABLES[digit])
        if token_id == 0:
            return "".join(syllables)


def input_digest(input_ids: list[int]) -> str:
    return hashlib.sha1(orjson.dumps(input_ids)).hexdigest()


class Scheduler:
    """At most `max_running` requests run at once; the rest wait first come, first served, as in SGLang."""

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self.running = 0
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.peak_running = 0
        self.peak_in_flight = 0

    @property
    def queued(self) -> int:
        return sum(not ticket.done() for ticket in self.waiting)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self._admit()
        try:
            yield
        finally:
            self._release()

    async def _admit(self) -> None:
        if self.running < self.max_running and not self.waiting:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            self.peak_in_flight = max(self.peak_in_flight, self.running + len(self.waiting))
            return
        ticket = asyncio.get_running_loop().create_future()
        self.waiting.append(ticket)
        self.peak_in_flight = max(self.peak_in_flight, self.running + len(self.waiting))
        try:
            await ticket
        except asyncio.CancelledError:
            if ticket.cancelled():
                with contextlib.suppress(ValueError):
                    self.waiting.remove(ticket)
            else:  # a finishing request handed us its slot just as our client went away
                self._release()
            raise

    def _release(self) -> None:
        while self.waiting:
            ticket = self.waiting.popleft()
            if not ticket.done():
                ticket.set_result(None)  # the slot passes straight on, so `running` stays the same
                return
        self.running -= 1


async def until_disconnected(request: Request) -> None:
    """Return once the client has gone: the body is read, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Simulator:
    """The HTTP endpoints and the state behind them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model_name: str = args.served_model_name or args.model_path
        self.scheduler = Scheduler(args.max_running)
        # Faults draw from their own stream, so a retried prompt is not doomed to fail the same way again.
        self.faults = random.Random(args.seed)
        self.stats: Counter[str] = Counter()
        self.inputs: Counter[str] = Counter()
        self.used_tokens = 0
        self.exiting = False
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
            message = "Simulated server error (--error-rate)"
            content = {"object": "error", "message": message, "type": "503", "param": None, "code": 503}
            return JSONResponse(content, status_code=503)
        try:
            prompts, single = parse_generate(body, self.args.vocab_size)
            for prompt in prompts:
                self.check_length(prompt)
        except Refused as refused:
            self.stats["errors"] += 1
            return JSONResponse(refused.body, status_code=400)
        self.inputs.update(input_digest(prompt.input_ids) for prompt in prompts)
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
            crash = BackgroundTask(self.crash)
        outputs = work.result()
        return JSONResponse(outputs[0] if single else outputs, background=crash)

    def check_length(self, prompt: Prompt) -> None:
        """SGLang's TokenizerManager._validate_one_request, without auto-truncation."""
        context_length = self.args.context_length
        input_tokens = len(prompt.input_ids)
        if input_tokens >= context_length:
            raise value_error(
                f"The input ({input_tokens} tokens) is longer than the model's context length "
                f"({context_length} tokens)."
            )
        max_new = prompt.params.get("max_new_tokens")  # SGLang checks only an explicit one
        if max_new is not None and input_tokens + max_new > context_length:
            raise value_error(
                f"Requested token count exceeds the model's maximum context length of {context_length} "
                f"tokens. You requested a total of {input_tokens + max_new} tokens: {input_tokens} tokens "
                f"from the input messages and {max_new} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )

    def sample(self, prompt: Prompt) -> tuple[list[int], dict[str, Any]]:
        """The output ids and finish reason SGLang would report, minus faults."""
        params = prompt.params
        sampling = {key: value for key, value in params.items() if key not in SHAPING_KEYS and value is not None}
        sampling = {**SAMPLING_DEFAULTS, **sampling}
        sampling = {key: float(value) if SCALAR_TYPES.get(key) == "f64" else value for key, value in sampling.items()}
        seed_material = orjson.dumps([self.args.seed, prompt.input_ids, sampling], option=orjson.OPT_SORT_KEYS)
        rng = random.Random(hashlib.sha256(seed_material).digest())
        natural = max(
            rng.randint(self.args.min_output_tokens, self.args.max_output_tokens), params.get("min_new_tokens") or 0
        )
        limit = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if limit is None:  # no limit but the context
            limit = self.args.context_length - len(prompt.input_ids)
        eos = self.args.eos_token_id
        stop_ids = set(params.get("stop_token_ids") or ())
        output: list[int] = []
        while len(output) < limit:
            if len(output) == natural and not params.get("ignore_eos"):
                output.append(eos)
                return output, {"type": "stop", "matched": eos}
            token = rng.randrange(FIRST_WORD_ID, self.args.vocab_size)
            output.append(token)
            if token in stop_ids:
                return output, {"type": "stop", "matched": token}
        return output, {"type": "length", "length": limit}

    def detokenize(self, output_ids: list[int], skip_special_tokens: bool) -> str:
        words = []
        for token in output_ids:
            if token == self.args.eos_token_id or token < FIRST_WORD_ID:
                if not skip_special_tokens:
                    words.append("<|eos|>" if token == self.args.eos_token_id else f"<|special_{token}|>")
            else:
                words.append(word(token))
        return " ".join(words)

    async def run_prompt(self, prompt: Prompt, arrived: float) -> dict[str, Any]:
        output_ids, finish_reason = self.sample(prompt)
        if self.faults.random() < self.args.abort_rate:
            output_ids = output_ids[: len(output_ids) // 2]
            finish_reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
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
        skip_special_tokens = prompt.params.get("skip_special_tokens")
        return {
            "text": self.detokenize(output_ids, skip_special_tokens is not False),
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

    async def crash(self) -> None:
        await asyncio.sleep(EXIT_GRACE_SECONDS)
        log.warning("--exit-after %d reached: exiting abruptly, dropping open connections", self.args.exit_after)
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
                "tokenizer_path": args.model_path,
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
                "tokenizer_path": self.args.model_path,
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


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="default: SGLang's 30000")
    parser.add_argument("--model-path", default="simulated-model", help="the name it reports, nothing is loaded")
    parser.add_argument("--served-model-name", help="default: --model-path")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY`, as SGLang's --api-key does")
    parser.add_argument("--context-length", type=positive_int, default=32768)
    parser.add_argument("--vocab-size", type=positive_int, default=32000, help="output ids are in [3, this)")
    parser.add_argument("--eos-token-id", type=int, default=2)
    parser.add_argument("--min-output-tokens", type=int, default=16, help="shortest natural answer before EOS")
    parser.add_argument("--max-output-tokens", type=int, default=256, help="longest natural answer before EOS")
    parser.add_argument("--token-latency", type=float, default=0.002, help="seconds per generated token")
    parser.add_argument("--prefill-latency", type=float, default=0.0, help="seconds per 1000 prompt tokens")
    parser.add_argument(
        "--max-running",
        "--max-running-requests",
        dest="max_running",
        type=positive_int,
        default=256,
        help="requests running at once; later ones queue in arrival order",
    )
    parser.add_argument(
        "--max-total-tokens",
        type=positive_int,
        default=1 << 20,
        help="KV cache size reported and used for sglang:token_usage (it admits nothing)",
    )
    parser.add_argument("--seed", type=int, default=0, help="changes every output and the fault draws")
    faults = parser.add_argument_group("faults")
    faults.add_argument(
        "--exit-after", type=positive_int, help="die abruptly (os._exit) after answering this many /generate requests"
    )
    faults.add_argument(
        "--abort-rate",
        type=fraction,
        default=0.0,
        help="fraction of prompts finished early with finish_reason abort (HTTP 200)",
    )
    faults.add_argument("--error-rate", type=fraction, default=0.0, help="fraction of /generate answered 503")
    faults.add_argument("--hang", action="store_true", help="/generate and /health_generate never answer")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= args.min_output_tokens <= args.max_output_tokens:
        log.error("need 0 <= --min-output-tokens <= --max-output-tokens")
        return 2
    if args.vocab_size <= FIRST_WORD_ID:
        log.error("--vocab-size must be above %d", FIRST_WORD_ID)
        return 2
    simulator = Simulator(args)
    log.info(
        "SGLang SIMULATOR (not a real server, no model loaded) for %s starting on http://%s:%d",
        simulator.model_name,
        args.host,
        args.port,
    )
    config = uvicorn.Config(
        simulator.app(),
        host=args.host,
        port=args.port,
        log_config=None,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=2,
    )
    uvicorn.Server(config).run()
    return 0
