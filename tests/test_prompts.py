"""Reading records into prompts: every accepted shape, and each kind of bad record named."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from producer.prompts import Prompt, Reject, Rejected, parse_record, read_prompts


def parse(record: object, index: int = 0) -> Prompt:
    return parse_record(orjson.dumps(record), index)


def test_each_shape_becomes_messages_or_ids():
    assert parse({"prompt": "Hi"}, 4).messages == [{"role": "user", "content": "Hi"}]
    assert parse({"prompt": "Hi"}, 4).sample_id == 4  # the line number when no id is given
    sharegpt = parse({"id": "s", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]})
    # The trailing answer is what gets generated: it is dropped.
    assert sharegpt.messages == [{"role": "user", "content": "Q"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = parse({"id": 7, "messages": [{"role": "user", "content": "Q"}], "tools": tools})
    assert (chat.sample_id, chat.tools) == (7, tools)
    assert parse({"input_ids": [1, 2]}).input_ids == [1, 2]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ([1], "expected a JSON object"),
        ({"id": "x"}, "found none"),
        ({"prompt": "a", "input_ids": [1]}, "expected exactly one of"),
        ({"prompt": " "}, "non-empty string"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "assistant", "content": "A"}]}, "empty prompt"),
        ({"messages": [{"role": "robot", "content": "A"}]}, "needs a role"),
        ({"conversations": [{"from": "alien", "value": "A"}]}, "unknown speaker"),
        ({"input_ids": [1, -2]}, "non-negative integers"),
        ({"id": True, "prompt": "a"}, "id must be"),
        ({"prompt": "a", "tools": {"name": "f"}}, "tools must be a list"),
    ],
)
def test_bad_records_say_what_is_wrong(record: object, reason: str):
    with pytest.raises(Rejected, match=reason):
        parse(record)


def test_a_file_yields_rejects_with_file_and_line_and_skips_blank_lines(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "Q"}\n\n{not json\n{"id": "a", "prompt": "again"}\n')
    first, malformed, duplicate = read_prompts(path)
    assert isinstance(first, Prompt) and first.line == 1
    assert isinstance(malformed, Reject) and (malformed.line, malformed.file) == (3, str(path))
    assert "malformed JSON" in malformed.reason
    assert isinstance(duplicate, Reject) and duplicate.reason == "duplicate id 'a' (first on line 1)"


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_record(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "Q"}\n{"id": "b", "prompt": "R"}\n')
    assert [prompt.sample_id for prompt in read_prompts(path)] == ["a", "b"]


def test_sampling_options_sglang_would_refuse_are_refused_at_enqueue(tmp_path: Path):
    from producer.partitions import PartitionError, load_partitions

    (tmp_path / "p.jsonl").write_text('{"prompt": "Q"}\n')
    (tmp_path / "partitions.toml").write_text("[p]\ntop_k = 0\n")
    with pytest.raises(PartitionError, match=r"\[p\] top_k: Value error, must be -1 \(no limit\) or at least 1"):
        load_partitions(tmp_path, ["all"])
