"""What a trainer will see of an exported row, token by token, against what the server generated.

A `specforge` or `raw` row carries the ids themselves. SpecForge tokenizes a `text` row again, and renders
a `sharegpt` row with a chat template before tokenizing it (`specforge/data/parse.py`: `apply_chat_template`,
then the tokenizer without special tokens added), and neither need give the generated ids back: a model may
emit a sequence its tokenizer would never make of the same text, a template may re-space JSON, drop a field
or add a system prompt. Here each row is tokenized as SpecForge would, with the model's own tokenizer and
template, and compared with the prompt's ids followed by the generated ids.
"""

from __future__ import annotations

from typing import Any

from common.records import OutputRecord
from producer.dataset.formats import generated_ids, is_truncated
from producer.tokenizer import ChatTokenizer

# Tokens shown on each side where two sequences part.
SHOWN = 3


def drift(export_format: str, row: dict[str, Any], record: OutputRecord, tokenizer: ChatTokenizer) -> str | None:
    """Where the tokens a trainer sees in `row` part from the generation; None when they are the generation."""
    generated = generated_ids(record)
    if export_format == "specforge":
        mask = [0] * len(record.input_ids) + [1] * len(record.output_ids)
        if row.get("loss_mask") != mask:
            return "loss_mask does not mark exactly the generated tokens"
        return _first_difference(row.get("input_ids", []), generated, record, tokenizer, exact=True)
    if export_format == "raw":
        seen = [*row.get("input_ids", []), *row.get("output_ids", [])]
        return _first_difference(seen, generated, record, tokenizer, exact=True)
    if export_format == "text":
        return _first_difference(tokenizer.tokenize(row.get("text", "")), generated, record, tokenizer, exact=True)
    try:
        rendered = tokenizer.render(row.get("conversations", []), row.get("tools"))
    except Exception as error:  # a template raises whatever jinja or its own checks raise
        return f"the chat template fails on it: {type(error).__name__}: {error}"
    # What a template writes after a finished turn (a newline, the next turn's header) is not trained on.
    return _first_difference(tokenizer.tokenize(rendered), generated, record, tokenizer, exact=False)


def _first_difference(
    seen: list[int], generated: list[int], record: OutputRecord, tokenizer: ChatTokenizer, exact: bool
) -> str | None:
    position = next((i for i, (a, b) in enumerate(zip(seen, generated, strict=False)) if a != b), None)
    if position is None and len(seen) < len(generated):
        position = len(seen)
    if position is None:
        if len(seen) > len(generated) and (exact or is_truncated(record)):
            added = tokenizer.name_of(seen[len(generated) : len(generated) + SHOWN])
            return f"{len(seen) - len(generated)} tokens after the generation that the server never made: {added}"
        return None
    prompt = len(record.input_ids)
    where = f"prompt token {position}" if position < prompt else f"generated token {position - prompt}"
    trained = tokenizer.name_of(seen[position : position + SHOWN])
    made = tokenizer.name_of(generated[position : position + SHOWN])
    return f"{where}: a trainer sees {trained} where the server had {made}"
