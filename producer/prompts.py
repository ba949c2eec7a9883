"""Reading a partition's records into prompts, and rejecting the ones that cannot be sent.

A record is one JSON object per line with an optional `"id"` (string or integer; default: its
0-based line number) and exactly one of:
- `"messages"`: OpenAI chat messages, with optional `"tools"`;
- `"conversations"`: ShareGPT turns, `from`/`value` or `role`/`content`;
- `"prompt"`: a string, sent as one user message;
- `"input_ids"`: an already tokenized prompt.
Trailing assistant turns are dropped: the response is what gets generated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

UTF8_BOM = b"\xef\xbb\xbf"
PROMPT_FIELDS = ("messages", "conversations", "prompt", "input_ids")
ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
    "function_response": "tool",
    "observation": "tool",
}


class Rejected(Exception):
    """A record that will not be enqueued; the message says why."""


@dataclass
class Prompt:
    """One parsed record: chat messages to render, or input IDs to send as they are."""

    line: int
    sample_id: str | int
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None


@dataclass
class Reject:
    file: str
    line: int
    reason: str
    sample_id: str | int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


def prompt_version(prompt: Prompt, sampling_params: dict[str, Any]) -> str:
    """A digest of what an output of this prompt is generated from: its turns and tools (or ids) and the
    sampling parameters. An output counts for the prompt only if it was made from the same."""
    material = orjson.dumps(
        [prompt.messages, prompt.tools, prompt.input_ids, sampling_params], option=orjson.OPT_SORT_KEYS
    )
    return hashlib.blake2b(material, digest_size=8).hexdigest()


def read_prompts(path: Path, find_duplicates: bool = True) -> Iterator[Prompt | Reject]:
    """Every line of `path` as a Prompt, or a Reject naming the file, line (1-based) and reason.

    Finding duplicate ids costs memory for every id; readers that take the rejects report's word on them
    (export, verify) leave it out.
    """
    # The line of each id so far, by the id's hash: a million ids as strings would cost 100s of MB.
    seen: dict[int, int] = {}
    with open(path, "rb") as file:
        for index, raw in enumerate(file):
            line = index + 1
            if index == 0:
                raw = raw.removeprefix(UTF8_BOM)  # editors such as Notepad begin a UTF-8 file with one
            if not raw.strip():
                continue
            try:
                prompt = parse_record(raw, index)
            except Rejected as error:
                yield Reject(str(path), line, str(error))
                continue
            key = str(prompt.sample_id)
            if not find_duplicates:
                yield prompt
                continue
            if hash(key) in seen:
                first = seen[hash(key)]
                yield Reject(str(path), line, f"duplicate id {key!r} (first on line {first})", prompt.sample_id)
                continue
            seen[hash(key)] = line
            yield prompt


def parse_record(raw: bytes, index: int) -> Prompt:
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise Rejected(f"malformed JSON: {error}") from error
    if not isinstance(record, dict):
        raise Rejected(f"expected a JSON object, got {type(record).__name__}")

    sample_id = record.get("id", index)
    if isinstance(sample_id, bool) or not isinstance(sample_id, str | int) or sample_id == "":
        raise Rejected(f"id must be a non-empty string or an integer, got {sample_id!r}")

    present = [field for field in PROMPT_FIELDS if field in record]
    if len(present) != 1:
        found = ", ".join(present) if present else "none"
        raise Rejected(f"expected exactly one of {', '.join(PROMPT_FIELDS)}; found {found}")
    field = present[0]
    prompt = Prompt(line=index + 1, sample_id=sample_id)

    if field == "input_ids":
        ids = record["input_ids"]
        if not _are_token_ids(ids):
            raise Rejected("input_ids must be a non-empty list of non-negative integers")
        prompt.input_ids = ids
        return prompt

    if field == "prompt":
        text = record["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise Rejected("prompt must be a non-empty string")
        messages = [{"role": "user", "content": text}]
    elif field == "messages":
        messages = _check_messages(record["messages"])
    else:
        messages = _from_sharegpt(record["conversations"])

    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise Rejected("tools must be a list of objects")
    prompt.messages = _drop_trailing_assistant(messages)
    prompt.tools = tools or None
    return prompt


def _are_token_ids(ids: Any) -> bool:
    """A non-empty list of non-negative integers (not booleans), checked in C: prompts run to 100,000s of tokens."""
    return isinstance(ids, list) and bool(ids) and set(map(type, ids)) == {int} and min(ids) >= 0


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise Rejected("messages must be a non-empty list")
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise Rejected(f"messages[{number}] needs a role, one of {', '.join(sorted(ROLES))}")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise Rejected(f"messages[{number}].content must be a string, a list of parts or null")
    return messages


def _from_sharegpt(turns: Any) -> list[dict[str, Any]]:
    if not isinstance(turns, list) or not turns:
        raise Rejected("conversations must be a non-empty list")
    messages = []
    for number, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise Rejected(f"conversations[{number}] must be an object")
        speaker = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        role = SHAREGPT_ROLES.get(str(speaker).lower())
        if role is None:
            raise Rejected(f"conversations[{number}] has unknown speaker {speaker!r}")
        if not isinstance(content, str):
            raise Rejected(f"conversations[{number}] needs a string value")
        messages.append({"role": role, "content": content})
    return messages


def _drop_trailing_assistant(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    kept = messages[:end]
    if not any(message["role"] in ("user", "tool") and _has_text(message.get("content")) for message in kept):
        raise Rejected("empty prompt: no user or tool turn with content before the assistant's response")
    return kept


def _has_text(content: Any) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, list):
        return any(isinstance(part, dict) and str(part.get("text", "")).strip() for part in content)
    return False
