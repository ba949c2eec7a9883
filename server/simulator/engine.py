"""The simulated engine: a real tokenizer's vocabulary, made-up generations, and SGLang's first-come scheduler.

A generation is a deterministic function of the prompt, the sampling params and the seed, so a prompt run
twice gives the same answer. Its ids come from the tokenizer's vocabulary: ordinary tokens drawn at
random (which, like a real model's output, need not be the tokenizer's own encoding of their text), and,
when the tokenizer and its chat template have them, reasoning (`<think>...</think>`) and tool-call
(`<tool_call>{...}</tool_call>`) markers around them. It ends with the tokenizer's end token, as SGLang
reports it: the token stays in `output_ids`, is trimmed from `text` (detokenizer_manager.py
`trim_matched_stop`) unless `no_stop_trim`, and `max_new_tokens` is cut to what the context leaves
(scheduler.py `init_req_max_new_tokens`: context length - 1 - prompt - 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import re
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from server.simulator.contract import DEFAULT_MAX_NEW_TOKENS, SCALAR_TYPES, Prompt

# transformers warns on import that PyTorch is missing; the simulator needs only its tokenizers.
logging.getLogger("transformers").addFilter(lambda record: "PyTorch was not found" not in record.getMessage())

from transformers import AutoTokenizer  # noqa: E402

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
REASONING = ("<think>", "</think>")
TOOL_CALL = ("<tool_call>", "</tool_call>")
# How often a generation reasons (and of those, with an empty block), and calls an offered tool.
REASONING_SHARE, EMPTY_REASONING_SHARE, TOOL_CALL_SHARE = 0.8, 0.1, 0.7
_TOOL_NAME = re.compile(r'"name":\s*"([^"]+)"')


class TokenizerError(Exception):
    """The tokenizer cannot be loaded or has no end token; the message says which."""


@dataclass
class Generation:
    output_ids: list[int]
    finish_reason: dict[str, Any]
    text: str


class Model:
    """What the simulator knows of the model: its tokenizer, and how it makes up answers."""

    def __init__(self, tokenizer_path: str, context_length: int, lengths: tuple[int, int], seed: int) -> None:
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        except (OSError, ValueError) as error:
            reason = " ".join(str(error).split())
            raise TokenizerError(f"cannot load the tokenizer {tokenizer_path}: {reason}") from None
        if self.tokenizer.eos_token_id is None:
            raise TokenizerError(f"the tokenizer {tokenizer_path} names no eos_token")
        self.eos = self.tokenizer.eos_token_id
        self.vocab_size = len(self.tokenizer)
        self.context_length = context_length
        self.lengths = lengths
        self.seed = seed
        special = set(self.tokenizer.all_special_ids)
        special |= {index for index, token in self.tokenizer.added_tokens_decoder.items() if token.special}
        # Ordinary tokens of printable text (no control character, no half of a multi-byte character): what
        # answers are made of.
        self.words = [
            index
            for index in range(self.vocab_size)
            if index not in special and _readable(self.tokenizer.decode([index]))
        ]
        self.reasoning = self._markers(REASONING)
        self.tool_call = self._markers(TOOL_CALL)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def generate(self, prompt: Prompt) -> Generation:
        """The output ids, finish reason and text SGLang would answer, minus faults."""
        params = prompt.params
        rng = random.Random(self._seed_material(prompt))
        min_new = params.get("min_new_tokens") or 0
        planned = self._plan(rng, prompt.input_ids, max(rng.randint(*self.lengths), min_new))
        limit = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        room = max(0, self.context_length - len(prompt.input_ids) - 2)
        limit = room if limit is None else min(limit, room)
        # SGLang's ignore_eos also ignores stop_token_ids, and no end token comes before min_new_tokens.
        ignore_eos = bool(params.get("ignore_eos"))
        planned += self._words(rng, (limit if ignore_eos else min_new) - len(planned))
        stop_ids = set() if ignore_eos else {self.eos, *(params.get("stop_token_ids") or ())}
        if not ignore_eos:
            planned.append(self.eos)
        output: list[int] = []
        finish: dict[str, Any] = {"type": "length", "length": limit}
        for token in planned[:limit]:
            output.append(token)
            if token in stop_ids:
                finish = {"type": "stop", "matched": token}
                break
        return Generation(output, finish, self.text(output, finish, params))

    def text(self, output_ids: list[int], finish_reason: dict[str, Any], params: dict[str, Any]) -> str:
        """`text` as SGLang's detokenizer makes it: the matched stop token trimmed unless `no_stop_trim`."""
        shown = output_ids
        if isinstance(finish_reason.get("matched"), int) and not params.get("no_stop_trim"):
            shown = output_ids[:-1]
        return self.tokenizer.decode(shown, skip_special_tokens=params.get("skip_special_tokens") is not False)

    def _seed_material(self, prompt: Prompt) -> bytes:
        sampling = {key: value for key, value in prompt.params.items() if key not in SHAPING_KEYS and value is not None}
        sampling = {**SAMPLING_DEFAULTS, **sampling}
        sampling = {key: float(value) if SCALAR_TYPES.get(key) == "f64" else value for key, value in sampling.items()}
        material = orjson.dumps([self.seed, prompt.input_ids, sampling], option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(material).digest()

    def _plan(self, rng: random.Random, input_ids: list[int], length: int) -> list[int]:
        """About `length` tokens: reasoning if the model has it, then a tool call if one was offered, else words."""
        planned: list[int] = []
        if self.reasoning and rng.random() < REASONING_SHARE:
            start, end = self.reasoning
            if rng.random() < EMPTY_REASONING_SHARE:
                planned += [start, *self.encode("\n\n"), end, *self.encode("\n\n")]
            else:
                thought = self._words(rng, length // 2)
                planned += [start, *self.encode("\n"), *thought, *self.encode("\n"), end, *self.encode("\n\n")]
        if self.tool_call and self.tool_call[0] in input_ids and rng.random() < TOOL_CALL_SHARE:
            start, end = self.tool_call
            names = _TOOL_NAME.findall(self.tokenizer.decode(input_ids)) or ["tool"]
            arguments = {"query": self.tokenizer.decode(self._words(rng, rng.randint(1, 4))).strip()}
            call = orjson.dumps({"name": rng.choice(names), "arguments": arguments}).decode()
            return [*planned, start, *self.encode(f"\n{call}\n"), end]
        return planned + self._words(rng, max(1, length - len(planned)))

    def _words(self, rng: random.Random, count: int) -> list[int]:
        return [rng.choice(self.words) for _ in range(count)]

    def _markers(self, pair: tuple[str, str]) -> tuple[int, int] | None:
        """The ids of a marker pair, when the vocabulary has both and the chat template uses them."""
        vocabulary = self.tokenizer.get_vocab()
        template = self.tokenizer.chat_template or ""
        if isinstance(template, dict):
            template = "\n".join(template.values())
        if all(marker in vocabulary and marker in template for marker in pair):
            return vocabulary[pair[0]], vocabulary[pair[1]]
        return None


def _readable(text: str) -> bool:
    return bool(text) and "\ufffd" not in text and all(char.isprintable() or char in "\n\t" for char in text)


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
