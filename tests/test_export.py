"""`export`: SpecForge's pre-tokenized rows exactly as generated, text and ShareGPT, raw records, the manifest."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
import orjson
import pytest

from common.protocol.keys import job_id
from common.records import OutputRecord
from common.store import LocalStore
from producer.prompts import parse_record
from producer.tokenizer import ChatTokenizer
from tests.harness import ROOT, Fleet, Simulator, bpe_tokenizer

TOKENIZER = str(ROOT / "sample" / "tokenizer")
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
SAMPLING = {"temperature": 0.6, "max_new_tokens": 64, "skip_special_tokens": False}
# What the producer sends for a partition with the default settings.
SAMPLED = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": -1,
    "min_p": 0.0,
    "max_new_tokens": 10240,
    "skip_special_tokens": False,
}


def commit(
    fleet: Fleet,
    partition: str,
    line: int,
    output_ids: list[int],
    finish: str = "stop",
    minute: int = 0,
) -> OutputRecord:
    """The output a worker commits for the prompt on `line` (0-based) of the partition: its ids as the producer
    made them, then `output_ids` with `text` as SGLang returns it (the matched end token trimmed)."""
    tokenizer = ChatTokenizer(fleet.env["FLEET_TOKENIZER"])
    prompt = parse_record((fleet.data_dir / f"{partition}.jsonl").read_bytes().splitlines()[line], line)
    input_ids = tokenizer.encode(prompt)
    shown = output_ids[:-1] if finish == "stop" else output_ids
    record = OutputRecord(
        id=prompt.sample_id,
        partition=partition,
        job_id=job_id(partition, prompt.sample_id),
        input_ids=input_ids,
        output_ids=output_ids,
        text=tokenizer.decode(shown),
        finish_reason={"type": "stop", "matched": output_ids[-1]} if finish == "stop" else {"type": "length"},
        prompt_tokens=len(input_ids),
        completion_tokens=len(output_ids),
        sampling_params=SAMPLING,
        server="http://gpu-1:30000",
        created_at=datetime(2026, 1, 1, 12, minute, tzinfo=UTC),
    )
    assert LocalStore(fleet.output_dir).commit(record)
    return record


def ids_of(text: str, tokenizer: ChatTokenizer) -> list[int]:
    return tokenizer.tokenize(text)


def read_jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


@pytest.fixture
def bpe(fleet: Fleet, tmp_path: Path) -> ChatTokenizer:
    fleet.env["FLEET_TOKENIZER"] = str(bpe_tokenizer(tmp_path / "bpe"))
    return ChatTokenizer(fleet.env["FLEET_TOKENIZER"])


def test_specforge_rows_hold_exactly_the_generated_ids_where_text_would_not(fleet: Fleet, bpe: ChatTokenizer):
    fleet.write_partition(
        "chat", [{"id": "split", "prompt": "Say hello"}, {"id": "plain", "prompt": "Weather in Paris?"}]
    )
    vocabulary = bpe.tokenizer.get_vocab()
    end = bpe.tokenizer.eos_token_id
    # `hell` `o`: the model's own tokens, which its tokenizer would encode as the one token `hello`.
    split = commit(fleet, "chat", 0, [vocabulary["hell"], vocabulary["o"], end])
    plain = commit(fleet, "chat", 1, [*ids_of("sunny", bpe), end])
    assert bpe.tokenize(bpe.decode(split.output_ids)) != split.output_ids
    out = fleet.directory / "specforge"

    result = fleet.producer("export", "--out", str(out), "--format", "specforge")

    rows = read_jsonl(out / "chat.jsonl")
    for row, record in zip(rows, (split, plain), strict=True):
        assert row == {
            "id": record.id,
            "input_ids": record.input_ids + record.output_ids,
            "loss_mask": [0] * len(record.input_ids) + [1] * len(record.output_ids),
            "finish_reason": "stop",
            "partition": "chat",
        }
    longest = max(len(split.input_ids) + 3, len(plain.input_ids) + len(plain.output_ids))
    assert f"data.max_length >= {longest}" in result.stdout
    assert orjson.loads((out / "manifest.json").read_bytes())["longest_tokens"] == longest
    code = fleet.producer("verify", "--export", str(out), check=False)
    assert code.returncode == 0 and "verify: all good, 2 outputs of 1 partition" in code.stdout, code.stdout

    text = fleet.directory / "text"
    result = fleet.producer("export", "--out", str(text), "--format", "text")
    assert [row["text"] for row in read_jsonl(text / "chat.jsonl")] == [
        bpe.decode(split.input_ids + split.output_ids),
        bpe.decode(plain.input_ids + plain.output_ids),
    ]
    assert "1 do not tokenize back into the generated ids" in result.stdout
    assert orjson.loads((text / "manifest.json").read_bytes())["partitions"]["chat"]["text_not_reencoding"] == 1
    verify = fleet.producer("verify", "--export", str(text))
    assert "exported rows a trainer would tokenize into other tokens than the generated ones" in verify.stdout
    assert "chat: 1 of 2 rows" in verify.stdout
    sees = "a trainer sees ['hello', '<|im_end|>'] where the server had ['hell', 'o', '<|im_end|>']"
    assert f"chat.jsonl:1 (id 'split'): generated token 0: {sees}" in verify.stdout

    sharegpt = fleet.directory / "sharegpt"
    fleet.producer("export", "--out", str(sharegpt), "--format", "sharegpt")
    verify = fleet.producer("verify", "--export", str(sharegpt))
    assert "chat: 1 of 2 rows" in verify.stdout and "(id 'split'): generated token 0:" in verify.stdout

    # A row changed after the export is a problem for the exact format: verify fails.
    damaged = read_jsonl(out / "chat.jsonl")
    damaged[1]["input_ids"][-2] += 1
    (out / "chat.jsonl").write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in damaged))
    result = fleet.producer("verify", "--export", str(out), check=False)
    assert result.returncode == 1
    assert "exported rows whose tokens are not exactly the prompt's and the generated ones (1):" in result.stdout
    assert "chat.jsonl:2 (id 'plain'): generated token" in result.stdout


def test_truncated_generations_are_left_out_of_training_formats_unless_asked(fleet: Fleet):
    fleet.env["FLEET_TOKENIZER"] = TOKENIZER
    fleet.write_partition("p", [{"id": n, "prompt": f"Question {n}?"} for n in range(3)])
    words = ChatTokenizer(TOKENIZER).tokenize
    commit(fleet, "p", 0, [*words("Four."), 2])
    commit(fleet, "p", 1, words("Let me think about"), finish="length")
    commit(fleet, "p", 2, [*words("Nine."), 2])
    out = fleet.directory / "export"

    result = fleet.producer("export", "--out", str(out))

    assert [row["id"] for row in read_jsonl(out / "p.jsonl")] == ["0", "2"]
    assert "1 cut at max_new_tokens left out (--include-truncated keeps them)" in result.stdout
    manifest = orjson.loads((out / "manifest.json").read_bytes())
    assert manifest["format"] == "specforge"
    assert manifest["options"] == {"include_truncated": False, "split_reasoning": False}
    assert (manifest["partitions"]["p"]["records"], manifest["partitions"]["p"]["truncated"]) == (2, 1)
    assert fleet.producer("verify", "--export", str(out)).returncode == 0

    kept = fleet.directory / "kept"
    fleet.producer("export", "--out", str(kept), "--format", "sharegpt", "--include-truncated")
    rows = read_jsonl(kept / "p.jsonl")
    assert [(row["id"], row["finish_reason"]) for row in rows] == [("0", "stop"), ("1", "length"), ("2", "stop")]
    verify = fleet.producer("verify", "--export", str(kept))
    # A template closes the cut generation with an end token the model never generated.
    assert "p: 1 of 3 rows" in verify.stdout
    assert "(id '1'): 2 tokens after the generation that the server never made: ['<|im_end|>'" in verify.stdout

    raw = fleet.directory / "raw"
    fleet.producer("export", "--out", str(raw), "--format", "raw")
    assert [row["id"] for row in read_jsonl(raw / "p.jsonl")] == [0, 1, 2]
    # An export that holds what its options leave out fails verify.
    (out / "p.jsonl").write_bytes((raw / "p.jsonl").read_bytes())
    result = fleet.producer("verify", "--export", str(out), check=False)
    assert result.returncode == 1 and "p.jsonl:2 (id '1') was cut at max_new_tokens" in result.stdout


def test_merged_sharegpt_files_keep_every_column_on_every_row(fleet: Fleet):
    fleet.env["FLEET_TOKENIZER"] = TOKENIZER
    fleet.write_partition("a_plain", [{"id": "hi", "conversations": [{"from": "human", "value": "Hi"}]}])
    fleet.write_partition(
        "b_tools", [{"id": "call", "messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER]}]
    )
    fleet.write_partition("c_ids", [{"id": "given", "input_ids": [5, 6, 7]}])
    tokenizer = ChatTokenizer(TOKENIZER)
    greeting = commit(fleet, "a_plain", 0, [*tokenizer.tokenize("Hello!"), 2])
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    call = f"<think>\nLook it up.\n</think>\n\n{call}"
    called = commit(fleet, "b_tools", 0, [*tokenizer.tokenize(call), 2])
    commit(fleet, "c_ids", 0, [100, 2])
    out = fleet.directory / "export"

    result = fleet.producer("export", "--out", str(out), "--format", "sharegpt")

    merged = [row for name in ("a_plain", "b_tools", "c_ids") for row in read_jsonl(out / f"{name}.jsonl")]
    assert [sorted(row) for row in merged] == [["conversations", "finish_reason", "id", "tools"]] * 2
    plain, tools = merged
    assert plain["tools"] == [] and tools["tools"] == [WEATHER]
    # The generated turn is the server's text, exactly: the chat template renders the generation back.
    assert plain["conversations"][-1] == {"role": "assistant", "content": greeting.text}
    assert tools["conversations"][-1] == {"role": "assistant", "content": called.text} and called.text == call
    assert "c_ids: 0 records" in result.stdout and "1 input_ids-only prompts skipped" in result.stdout
    assert "exported rows a trainer would" not in fleet.producer("verify", "--export", str(out)).stdout

    split = fleet.directory / "split"
    fleet.producer("export", "--out", str(split), "--format", "sharegpt", "--split-reasoning")
    [row] = read_jsonl(split / "b_tools.jsonl")
    assert row["conversations"][-1] == {
        "role": "assistant",
        "reasoning_content": "Look it up.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        "content": "",
    }
    # Rendered by the template, the split turn loses the newlines the model generated: verify says so.
    verify = fleet.producer("verify", "--export", str(split))
    assert "b_tools: 1 of 1 rows" in verify.stdout


def test_manifest_describes_the_export(fleet: Fleet):
    fleet.env["FLEET_TOKENIZER"] = TOKENIZER
    fleet.write_partition("a", [{"id": n, "prompt": f"Question {n}?"} for n in range(3)])
    fleet.write_partition("b", [{"id": "b-0", "prompt": "Lonely?"}])
    records = [commit(fleet, "a", n, [100 + n, 2], minute=10 - n) for n in range(3)]
    out = fleet.directory / "export"

    fleet.producer("export", "--out", str(out), "--format", "raw")

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
    # Raw records are the committed records, token IDs and all, in input order.
    assert [line["id"] for line in read_jsonl(out / "a.jsonl")] == [0, 1, 2]
    assert read_jsonl(out / "a.jsonl")[1] == orjson.loads(records[1].to_json())

    # Exporting one partition again keeps the other's entry; another format starts a new manifest.
    fleet.producer("export", "--out", str(out), "--partition", "b", "--format", "raw")
    assert sorted(orjson.loads((out / "manifest.json").read_bytes())["partitions"]) == ["a", "b"]
    fleet.producer("export", "--out", str(out), "--partition", "b")
    assert sorted(orjson.loads((out / "manifest.json").read_bytes())["partitions"]) == ["b"]


def test_a_bad_out_directory_or_tokenizer_fails_with_one_line(fleet: Fleet):
    fleet.env["FLEET_TOKENIZER"] = TOKENIZER
    fleet.write_partition("a", [{"id": 0, "prompt": "Question?"}])
    commit(fleet, "a", 0, [100, 2])
    (fleet.directory / "a-file").write_text("")
    out = fleet.directory / "a-file" / "export"

    result = fleet.producer("export", "--out", str(out), check=False)

    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"error: cannot write to the directory {out} (export --out)" in result.stderr

    missing = fleet.directory / "no-such-tokenizer"
    fleet.env["FLEET_TOKENIZER"] = str(missing)
    out = fleet.directory / "export"
    result = fleet.producer("export", "--out", str(out), check=False)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"error: cannot load the tokenizer FLEET_TOKENIZER={missing}: " in result.stderr
    assert not out.exists()


def test_the_pipeline_exports_what_the_server_generated(fleet: Fleet, start_simulator: Callable[..., Simulator]):
    simulator = start_simulator("--min-output-tokens", "4", "--max-output-tokens", "24")
    fleet.point_at(simulator)
    cities = [[{"role": "user", "content": f"Weather in city {n}?"}] for n in range(6)]
    weather = [{"messages": messages, "tools": [WEATHER]} for messages in cities]
    fleet.write_partition("p", [*({"id": f"q{n}", "prompt": f"Question {n}?"} for n in range(7)), *weather])
    fleet.producer("enqueue")
    assert fleet.start_worker("--burst").wait(timeout=60) == 0
    out = fleet.directory / "export"

    fleet.producer("export", "--out", str(out), "--strict")

    rows = read_jsonl(out / "p.jsonl")
    assert len(rows) == 13
    tokenizer, texts = ChatTokenizer(TOKENIZER), []
    for row in rows:
        prompt = [token for token, mask in zip(row["input_ids"], row["loss_mask"], strict=True) if not mask]
        generated = row["input_ids"][len(prompt) :]
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(generated)
        # Asked again, the (deterministic) server answers exactly the supervised tokens.
        body = {"input_ids": prompt, "sampling_params": SAMPLED}
        assert httpx.post(f"{simulator.url}/generate", json=body).json()["output_ids"] == generated
        texts.append(tokenizer.decode(generated))
    # The simulated model reasons and calls tools with the template's markers, as a real one would.
    assert any(text.startswith("<think>") for text in texts)
    assert any("<tool_call>" in text for text in texts)
