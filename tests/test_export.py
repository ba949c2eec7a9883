"""`export`: raw records and SpecForge's ShareGPT conversations, with the manifest beside them."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import orjson

from common.keys import job_id
from common.records import OutputRecord
from common.store import OutputStore
from producer.sharegpt import AssistantFormat, assistant_message
from producer.tokenizer import ChatTokenizer
from tests.support import ROOT, Fleet

TOKENIZER = str(ROOT / "sample" / "tokenizer")
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
SAMPLING = {"temperature": 0.6, "max_new_tokens": 64, "skip_special_tokens": False}


def commit(
    fleet: Fleet, partition: str, sample_id: str | int, text: str, finish: str = "stop", minute: int = 0
) -> OutputRecord:
    """An output as a worker commits it, generated text as SGLang returns it with skip_special_tokens off."""
    record = OutputRecord(
        id=sample_id,
        partition=partition,
        job_id=job_id(partition, sample_id),
        input_ids=[1, 2, 3],
        output_ids=[4, 5],
        text=text,
        finish_reason={"type": finish},
        prompt_tokens=3,
        completion_tokens=2,
        sampling_params=SAMPLING,
        server="http://gpu-1:30000",
        created_at=datetime(2026, 1, 1, 12, minute, tzinfo=UTC),
    )
    assert OutputStore(fleet.output_dir / "samples").commit(record)
    return record


def read_jsonl(path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_sharegpt_export_splits_reasoning_and_tool_calls_as_the_template_renders_them(fleet: Fleet):
    system, user = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}
    fleet.write_partition(
        "chat",
        [
            {"id": "think", "messages": [system, user, {"role": "assistant", "content": "an old answer"}]},
            {"id": "cut", "prompt": "Think long."},
            {"id": 7, "conversations": [{"from": "human", "value": "Hi"}]},
        ],
    )
    fleet.write_partition(
        "tools", [{"id": "call", "messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER]}]
    )
    fleet.write_partition("ids", [{"id": "given", "input_ids": [5, 6, 7]}])
    commit(fleet, "chat", "think", "<think>\nAdd them.\n</think>\n\n4<|im_end|>")
    commit(fleet, "chat", "cut", "<think>\nStill thinking about", finish="length")
    commit(fleet, "chat", 7, "Hello!<|im_end|>")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    commit(fleet, "tools", "call", f"Let me look.\n{call}<|im_end|>")
    commit(fleet, "ids", "given", "x<|im_end|>")
    out = fleet.directory / "export"

    result = fleet.producer("export", "--out", str(out), "--format", "sharegpt")

    think, cut, greeting = read_jsonl(out / "chat.jsonl")
    # The prompt's trailing assistant turn is dropped, as at enqueue: the generated one replaces it.
    assert think == {
        "id": "think",
        "conversations": [system, user, {"role": "assistant", "reasoning_content": "Add them.", "content": "4"}],
    }
    assert cut["conversations"][-1] == {"role": "assistant", "reasoning_content": "Still thinking about", "content": ""}
    assert greeting == {
        "id": "7",
        "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    }
    [tool_use] = read_jsonl(out / "tools.jsonl")
    assert tool_use["tools"] == [WEATHER]
    assert tool_use["conversations"][-1] == {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        "content": "Let me look.",
    }
    # The template renders the split fields back into the markers the model generated.
    tokenizer = ChatTokenizer(TOKENIZER).tokenizer
    rendered = tokenizer.apply_chat_template(think["conversations"], tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n<think>Add them.</think>4<|im_end|>\n")
    rendered = tokenizer.apply_chat_template(tool_use["conversations"], tools=tool_use["tools"], tokenize=False)
    assert rendered.endswith(f"assistant\nLet me look.{call}<|im_end|>\n")
    # An input_ids-only prompt has no turns to show: skipped, and said so.
    assert (out / "ids.jsonl").read_bytes() == b""
    assert "ids: 0 records" in result.stdout and "1 input_ids-only prompts skipped" in result.stdout


def test_markers_stay_in_the_content_when_the_template_has_no_fields_for_them():
    record = OutputRecord(
        id=1, partition="p", job_id="j", input_ids=[1], output_ids=[2], text="<think>hm</think>4<|im_end|>",
        finish_reason={"type": "stop"}, prompt_tokens=1, completion_tokens=1, sampling_params={}, server="s",
    )  # fmt: skip
    plain = AssistantFormat(reasoning=False, tool_calls=False, end_tokens=frozenset({"<|im_end|>"}))
    assert assistant_message(record, plain) == {"role": "assistant", "content": "<think>hm</think>4"}


def test_manifest_describes_the_export(fleet: Fleet):
    fleet.write_partition("a", [{"id": n, "prompt": f"Question {n}?"} for n in range(3)])
    fleet.write_partition("b", [{"id": "b-0", "prompt": "Lonely?"}])
    records = [commit(fleet, "a", n, f"Answer {n}<|im_end|>", minute=10 - n) for n in range(3)]
    out = fleet.directory / "export"

    fleet.producer("export", "--out", str(out))

    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert manifest["format"] == "raw" and manifest["records"] == 3
    assert manifest["tokenizer"] == {"name": TOKENIZER, "sha256": ChatTokenizer(TOKENIZER).digest()}
    a, b = manifest["partitions"]["a"], manifest["partitions"]["b"]
    assert (a["records"], a["missing"], b["records"], b["missing"]) == (3, 0, 0, 1)
    assert a["sha256"] == hashlib.sha256((out / "a.jsonl").read_bytes()).hexdigest()
    assert a["sampling_params"] == [SAMPLING] and a["servers"] == {"http://gpu-1:30000": 3}
    created = sorted(record.created_at for record in records)
    assert a["created"] == {"first": created[0].isoformat(), "last": created[-1].isoformat()}
    assert manifest["created"] == a["created"] and manifest["servers"] == {"http://gpu-1:30000": 3}
    # Raw records are the committed files, token IDs and all, in input order.
    assert [line["id"] for line in read_jsonl(out / "a.jsonl")] == [0, 1, 2]
    assert read_jsonl(out / "a.jsonl")[1] == orjson.loads(records[1].to_json())

    # Exporting one partition again keeps the other's entry.
    fleet.producer("export", "--out", str(out), "--partition", "b")
    assert sorted(orjson.loads((out / "manifest.json").read_bytes())["partitions"]) == ["a", "b"]


def test_a_bad_out_directory_or_tokenizer_fails_with_one_line(fleet: Fleet):
    fleet.write_partition("a", [{"id": 0, "prompt": "Question?"}])
    commit(fleet, "a", 0, "Answer<|im_end|>")
    (fleet.directory / "a-file").write_text("")
    out = fleet.directory / "a-file" / "export"

    result = fleet.producer("export", "--out", str(out), check=False)

    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"error: cannot write to the directory {out} (export --out)" in result.stderr

    missing = fleet.directory / "no-such-tokenizer"
    fleet.env["FLEET_TOKENIZER"] = str(missing)
    result = fleet.producer("export", "--out", str(fleet.directory / "export"), check=False)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"error: cannot load the tokenizer FLEET_TOKENIZER={missing}: " in result.stderr
