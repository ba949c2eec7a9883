"""ShareGPT records as SpecForge reads them: the prompt's turns, then the generated turn.

SpecForge (specforge/data/preprocessing.py and parse.py) reads a `conversations` column of
`role`/`content` messages; of an assistant message it keeps `tool_calls` (OpenAI's form, arguments
an object or a JSON string) and, with its thinking parser, `reasoning_content`. A `tools` column
goes to the chat template, `id` is dropped, and any other column is passed to the chat template as
a keyword, so no other column is written.

The generated text keeps what SGLang leaves in with `skip_special_tokens` off: reasoning in
`<think>...</think>`, tool calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, and
the end-of-turn token. Reasoning and tool calls move to their own fields only when the chat template
renders them from those fields, so that training renders what the model generated; the end-of-turn
token is dropped, as the template adds its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from common.keys import sample_key
from common.records import OutputRecord
from producer.prompts import Prompt
from producer.tokenizer import ChatTokenizer

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MARKERS = {THINK_START, THINK_END, "<tool_call>", "</tool_call>"}


@dataclass(frozen=True)
class AssistantFormat:
    """How the model's chat template renders an assistant turn, and which tokens end one."""

    reasoning: bool
    tool_calls: bool
    end_tokens: frozenset[str]

    @classmethod
    def of(cls, tokenizer: ChatTokenizer) -> AssistantFormat:
        template = tokenizer.tokenizer.chat_template or ""
        if isinstance(template, dict):  # named templates: any of them may be the one used
            template = "\n".join(template.values())
        return cls(
            reasoning="reasoning_content" in template,
            tool_calls="tool_calls" in template,
            end_tokens=frozenset(tokenizer.tokenizer.all_special_tokens) - MARKERS,
        )


def assistant_message(record: OutputRecord, style: AssistantFormat) -> dict[str, Any]:
    """The generated turn: content, and reasoning and tool calls where the template has fields for them."""
    text = _strip_end(record.text, style.end_tokens)
    message: dict[str, Any] = {"role": "assistant"}
    split = False
    if style.reasoning and (THINK_END in text or THINK_START in text):
        message["reasoning_content"], text = _split_reasoning(text)
        split = True
    if style.tool_calls:
        calls = [_tool_call(match.group(1)) for match in TOOL_CALL.finditer(text)]
        if calls and all(call is not None for call in calls):
            message["tool_calls"] = calls
            text = TOOL_CALL.sub("", text)
            split = True
    # Templates that render these fields put their own newlines around them.
    message["content"] = text.strip("\n") if split else text
    return message


def sharegpt_record(prompt: Prompt, record: OutputRecord, style: AssistantFormat) -> dict[str, Any] | None:
    """One conversation, or None for an input_ids-only prompt: it has no turns to show."""
    if prompt.messages is None:
        return None
    conversation = {
        "id": sample_key(prompt.sample_id),
        "conversations": [*prompt.messages, assistant_message(record, style)],
    }
    if prompt.tools:
        conversation["tools"] = prompt.tools
    return conversation


def _strip_end(text: str, end_tokens: frozenset[str]) -> str:
    stripped = True
    while stripped:
        stripped = False
        for token in end_tokens:
            if token and text.endswith(token):
                text = text[: -len(token)]
                stripped = True
    return text


def _split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, the rest). The generation prompt may have opened `<think>` itself, and a generation cut
    off while reasoning has no `</think>`."""
    if THINK_END not in text:
        before, _, reasoning = text.partition(THINK_START)
        return reasoning.strip("\n"), before
    head, _, after = text.partition(THINK_END)
    before, opened, reasoning = head.partition(THINK_START)
    if not opened:
        before, reasoning = "", head
    return reasoning.strip("\n"), before + after


def _tool_call(body: str) -> dict[str, Any] | None:
    try:
        call = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}
