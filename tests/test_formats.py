"""Export rows and what a trainer sees of them, in process, with a tokenizer whose decode-encode is not the identity."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.records import OutputRecord
from producer.dataset.fidelity import drift
from producer.dataset.formats import ExportOptions, assistant_turn, sharegpt_row, specforge_row, text_row
from producer.prompts import Prompt
from producer.tokenizer import ChatTokenizer
from tests.harness import bpe_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer(str(bpe_tokenizer(tmp_path_factory.mktemp("bpe"))))


def generation(tokenizer: ChatTokenizer, output_ids: list[int], finish: str = "stop") -> tuple[Prompt, OutputRecord]:
    prompt = Prompt(line=1, sample_id=3, messages=[{"role": "user", "content": "Say hello"}])
    input_ids = tokenizer.encode(prompt)
    shown = output_ids[:-1] if finish == "stop" else output_ids
    record = OutputRecord(
        id=3, partition="p", job_id="j", input_ids=input_ids, output_ids=output_ids, text=tokenizer.decode(shown),
        finish_reason={"type": finish}, prompt_tokens=len(input_ids), completion_tokens=len(output_ids),
        sampling_params={}, server="s",
    )  # fmt: skip
    return prompt, record


def test_only_the_specforge_row_keeps_a_non_canonical_generation(tokenizer: ChatTokenizer):
    vocabulary = tokenizer.tokenizer.get_vocab()
    prompt, record = generation(tokenizer, [vocabulary["hell"], vocabulary["o"], tokenizer.tokenizer.eos_token_id])
    row = specforge_row(record)
    assert row["input_ids"] == record.input_ids + record.output_ids
    assert row["loss_mask"] == [0] * len(record.input_ids) + [1] * 3
    assert (row["id"], row["finish_reason"], row["partition"]) == ("3", "stop", "p")
    assert drift("specforge", row, record, tokenizer) is None
    assert "generated token 0" in drift("text", text_row(record, tokenizer), record, tokenizer)
    assert "generated token 0" in drift("sharegpt", sharegpt_row(prompt, record, False), record, tokenizer)

    canonical_prompt, canonical = generation(
        tokenizer, [*tokenizer.tokenize("hello"), tokenizer.tokenizer.eos_token_id]
    )
    assert drift("text", text_row(canonical, tokenizer), canonical, tokenizer) is None
    assert drift("sharegpt", sharegpt_row(canonical_prompt, canonical, False), canonical, tokenizer) is None
    # A changed id or mask in a specforge row is caught.
    assert drift("specforge", {**row, "loss_mask": [1] * len(row["loss_mask"])}, record, tokenizer)
    assert drift("specforge", {**row, "input_ids": row["input_ids"][:-1]}, record, tokenizer)


def test_a_cut_generation_closed_by_the_template_trains_tokens_never_generated(tokenizer: ChatTokenizer):
    prompt, record = generation(tokenizer, tokenizer.tokenize("hello world"), finish="length")
    assert not ExportOptions("specforge").keeps(record) and ExportOptions("specforge", include_truncated=True).keeps(
        record
    )
    assert ExportOptions("raw").keeps(record)
    found = drift("sharegpt", sharegpt_row(prompt, record, False), record, tokenizer)
    assert found and "after the generation that the server never made: ['<|im_end|>'" in found
    assert drift("text", text_row(record, tokenizer), record, tokenizer) is None


def test_sharegpt_rows_have_every_column_and_split_reasoning_only_when_asked():
    record_text = '<think>\nhm\n</think>\n\nSure.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    assert assistant_turn(record_text, False) == {"role": "assistant", "content": record_text}
    assert assistant_turn(record_text, True) == {
        "role": "assistant",
        "reasoning_content": "hm",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        "content": "Sure.",
    }
    # A generation cut while reasoning has no end marker; a prompt that opened <think> itself has no start.
    assert assistant_turn("<think>\nstill", True)["reasoning_content"] == "still"
    assert assistant_turn("thought</think>answer", True) == {
        "role": "assistant",
        "reasoning_content": "thought",
        "content": "answer",
    }
    ids_only = Prompt(line=1, sample_id="x", input_ids=[1, 2])
    record = OutputRecord(
        id="x", partition="p", job_id="j", input_ids=[1, 2], output_ids=[3], text="t", finish_reason={"type": "stop"},
        prompt_tokens=2, completion_tokens=1, sampling_params={}, server="s",
    )  # fmt: skip
    assert sharegpt_row(ids_only, record, False) is None
    chat = Prompt(line=1, sample_id="x", messages=[{"role": "user", "content": "Q"}])
    assert sorted(sharegpt_row(chat, record, False)) == ["conversations", "finish_reason", "id", "tools"]
    assert sharegpt_row(chat, record, False)["tools"] == []


def test_manifest_options_round_trip(tmp_path: Path):
    options = ExportOptions("sharegpt", include_truncated=True, split_reasoning=True)
    assert ExportOptions("sharegpt", **options.to_json()) == options
