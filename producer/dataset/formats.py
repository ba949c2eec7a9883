"""The export formats: one JSON object per committed sample, built from the store's record and its prompt.

- `specforge`: SpecForge's pre-tokenized rows (`data.prompts_path`): `input_ids` are the prompt's ids
  followed by the generated ids, end token included, and `loss_mask` marks the generated ones. No
  tokenizer is involved, so the supervised tokens are exactly the ones the server generated.
- `text`: the same ids decoded into one string with special tokens kept, for SpecForge's
  `is_preformatted` path. SpecForge tokenizes it again, which need not give the same ids back.
- `sharegpt`: the prompt's turns and the generated turn, whose content is exactly the server's text, for
  SpecForge's conversation readers, which render it with a chat template and tokenize it again.
  `tools` is on every row (`[]` when none): SpecForge's offline reader takes its columns from the first
  row, so a merged file whose first row had no tools would drop them all. Reasoning and tool calls move
  to their own fields only when asked (`split_reasoning`): only SpecForge's thinking parsers read
  `reasoning_content`, its general parser drops it.
- `raw`: every field of the record, as the worker committed it.

Every format but `raw` leaves out generations cut at max_new_tokens unless asked to keep them: a chat
template would close them with end tokens the model never generated, and the draft model would learn
to stop where the target model did not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from common.protocol.keys import sample_key
from common.records import OutputRecord
from producer.prompts import Prompt

if TYPE_CHECKING:
    from producer.tokenizer import ChatTokenizer

FORMATS = ("raw", "specforge", "text", "sharegpt")
# Formats a trainer reads as token ids or text: the ones that leave truncated generations out by default.
TRAINING_FORMATS = ("specforge", "text", "sharegpt")

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ExportOptions:
    format: str = "raw"
    include_truncated: bool = False
    split_reasoning: bool = False

    @property
    def keeps_truncated(self) -> bool:
        return self.format not in TRAINING_FORMATS or self.include_truncated

    def keeps(self, record: OutputRecord) -> bool:
        """Whether `record` belongs in an export made with these options."""
        return self.keeps_truncated or not is_truncated(record)

    def to_json(self) -> dict[str, Any]:
        return {"include_truncated": self.include_truncated, "split_reasoning": self.split_reasoning}

    def row(self, prompt: Prompt, record: OutputRecord, tokenizer: ChatTokenizer) -> dict[str, Any] | None:
        """The exported row of one sample, or None where the format cannot show it."""
        if self.format == "specforge":
            return specforge_row(record)
        if self.format == "text":
            return text_row(record, tokenizer)
        if self.format == "sharegpt":
            return sharegpt_row(prompt, record, self.split_reasoning)
        return raw_row(record)


def is_truncated(record: OutputRecord) -> bool:
    return record.finish_reason.get("type") == "length"


def finish(record: OutputRecord) -> str:
    """The finish reason's type (`stop` or `length`): a plain string keeps the column one type for Arrow."""
    return str(record.finish_reason.get("type", ""))


def generated_ids(record: OutputRecord) -> list[int]:
    """The whole sequence the server saw and made: the prompt's ids, then the generated ones."""
    return [*record.input_ids, *record.output_ids]


def raw_row(record: OutputRecord) -> dict[str, Any]:
    return record.model_dump(mode="json")


def specforge_row(record: OutputRecord) -> dict[str, Any]:
    return {
        "id": sample_key(record.id),
        "input_ids": generated_ids(record),
        "loss_mask": [0] * len(record.input_ids) + [1] * len(record.output_ids),
        "finish_reason": finish(record),
        "partition": record.partition,
    }


def text_row(record: OutputRecord, tokenizer: ChatTokenizer) -> dict[str, Any]:
    return {
        "id": sample_key(record.id),
        "text": tokenizer.decode(generated_ids(record)),
        "finish_reason": finish(record),
    }


def sharegpt_row(prompt: Prompt, record: OutputRecord, split_reasoning: bool) -> dict[str, Any] | None:
    """One conversation, or None for an input_ids-only prompt: it has no turns to show."""
    if prompt.messages is None:
        return None
    return {
        "id": sample_key(record.id),
        "conversations": [*prompt.messages, assistant_turn(record.text, split_reasoning)],
        "tools": prompt.tools or [],
        "finish_reason": finish(record),
    }


def assistant_turn(text: str, split_reasoning: bool) -> dict[str, Any]:
    """The generated turn: the server's text, or with `split_reasoning` its reasoning and tool calls apart."""
    message: dict[str, Any] = {"role": "assistant"}
    if not split_reasoning:
        message["content"] = text
        return message
    if THINK_END in text or THINK_START in text:
        message["reasoning_content"], text = _split_reasoning(text)
    calls = [_tool_call(match.group(1)) for match in TOOL_CALL.finditer(text)]
    if calls and all(call is not None for call in calls):
        message["tool_calls"] = calls
        text = TOOL_CALL.sub("", text)
    # Templates that render the split fields put their own newlines around them.
    message["content"] = text.strip("\n") if len(message) > 1 else text
    return message


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
