"""The producer against a real redis-server: rejects, idempotence, concurrency, skip-done, options."""

from __future__ import annotations

import subprocess
import sys
import time

import orjson
import redis
from rq.job import Job
from transformers import AutoTokenizer

from common.protocol.keys import job_id
from common.protocol.scripts import ENQUEUE as ENQUEUE_SCRIPT
from common.protocol.serializer import PlainPickle
from common.records import OutputRecord, PromptRef
from common.store import LocalStore
from tests.harness import ROOT, Fleet, counts

TOKENIZER = str(ROOT / "sample" / "tokenizer")


def queued(client: redis.Redis, queue: str = "short") -> list[str]:
    return [item.decode() for item in client.lrange(f"rq:queue:{queue}", 0, -1)]


def job_kwargs(client: redis.Redis, identifier: str) -> dict:
    return Job.fetch(identifier, connection=client, serializer=PlainPickle).kwargs


def test_every_kind_of_bad_record_is_rejected_with_file_line_and_reason(fleet: Fleet, redis_client: redis.Redis):
    path = fleet.write_partition(
        "mixed",
        [
            {"id": "good-1", "prompt": "hello"},
            "{not json",
            "[1, 2, 3]",
            {"id": "no-prompt"},
            {"id": "two-shapes", "prompt": "a", "messages": [{"role": "user", "content": "b"}]},
            {"id": "empty", "prompt": "   "},
            {"id": "empty-messages", "messages": []},
            {"id": "only-assistant", "messages": [{"role": "assistant", "content": "hi"}]},
            {"id": "bad-role", "messages": [{"role": "wizard", "content": "hi"}]},
            {"id": "bad-speaker", "conversations": [{"from": "alien", "value": "hi"}]},
            {"id": "good-1", "prompt": "same id again"},
            {"id": True, "prompt": "boolean id"},
            {"id": "bad-ids", "input_ids": [1, -2]},
            {"id": "beyond-vocab", "input_ids": [1, 10**9]},
            {"id": "too-long", "input_ids": [5] * 40000},
            {"id": "good-2", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},
        ],
    )
    result = fleet.producer("enqueue", "--partition", "mixed", "--json")

    rejects = [orjson.loads(line) for line in (fleet.output_dir / "rejects" / "mixed.jsonl").read_bytes().splitlines()]
    reasons = {reject["line"]: reject["reason"] for reject in rejects}
    assert sorted(reasons) == list(range(2, 16))
    assert all(reject["file"] == str(path) for reject in rejects)
    assert "malformed JSON" in reasons[2]
    assert "expected a JSON object" in reasons[3]
    assert "found none" in reasons[4]
    assert "found messages, prompt" in reasons[5] or "found prompt, messages" in reasons[5]
    assert "non-empty string" in reasons[6]
    assert "non-empty list" in reasons[7]
    assert "empty prompt" in reasons[8]
    assert "role" in reasons[9]
    assert "unknown speaker" in reasons[10]
    assert "duplicate id 'good-1' (first on line 1)" in reasons[11]
    assert "id must be" in reasons[12]
    assert "non-negative integers" in reasons[13]
    assert "beyond the vocabulary" in reasons[14]
    assert "exceed the context length 32768" in reasons[15]

    assert counts(orjson.loads(result.stdout)["partitions"]["mixed"]) == (16, 0, 0, 0, 2, 14)
    assert sorted(queued(redis_client)) == sorted([fleet.job_id("mixed", "good-1"), fleet.job_id("mixed", "good-2")])


def test_chat_template_renders_messages_without_trailing_assistant_turns(fleet: Fleet, redis_client: redis.Redis):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4, as the reference says."},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    fleet.write_partition("chat", [{"id": 7, "messages": messages, "tools": tools}, {"prompt": "hi"}])
    fleet.producer("enqueue", "--partition", "chat")

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    expected = tokenizer.apply_chat_template(messages[:2], tools=tools, add_generation_prompt=True, tokenize=False)
    kwargs = job_kwargs(redis_client, fleet.job_id("chat", 7))
    # The job refers to its prompt's ids in the output store rather than carrying them.
    assert "input_ids" not in kwargs
    ids = LocalStore(fleet.output_dir).read_prompt(PromptRef.model_validate(kwargs["prompt"]))
    assert tokenizer.decode(ids) == expected
    assert kwargs["sample_id"] == 7
    # An ID defaults to the record's 0-based line number.
    assert job_kwargs(redis_client, fleet.job_id("chat", 1))["sample_id"] == 1
    params = kwargs["sampling_params"]
    assert params["max_new_tokens"] == 10240
    assert params["skip_special_tokens"] is False


def test_enqueue_twice_leaves_one_job_per_prompt(fleet: Fleet, redis_client: redis.Redis):
    fleet.write_partition("p", [{"prompt": f"question {n}"} for n in range(50)])
    assert counts(fleet.enqueued()) == (50, 0, 0, 0, 50, 0)
    assert counts(fleet.enqueued()) == (50, 0, 50, 0, 0, 0)
    assert len(queued(redis_client)) == 50


def test_concurrent_producers_enqueue_each_prompt_once(fleet: Fleet, redis_client: redis.Redis):
    fleet.write_partition("p", [{"prompt": f"question {n}"} for n in range(400)])
    command = [sys.executable, "-m", "producer", "enqueue", "--json"]
    producers = [
        subprocess.Popen(command, env=fleet.env, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in producers]
    assert all(process.returncode == 0 for process in producers)
    ids = queued(redis_client)
    assert len(ids) == 400 == len(set(ids))
    enqueued = [orjson.loads(output)["partitions"]["p"]["enqueued"] for output in outputs]
    assert sum(enqueued) == 400


def test_completed_samples_are_not_enqueued(fleet: Fleet, redis_client: redis.Redis):
    fleet.write_partition("p", [{"id": n, "prompt": f"question {n}"} for n in range(5)])
    store = LocalStore(fleet.output_dir)
    for sample in (1, 3):
        store.commit(
            OutputRecord(
                id=sample,
                partition="p",
                job_id=job_id("p", sample),
                input_ids=[1],
                output_ids=[2],
                text="",
                finish_reason={"type": "stop"},
                prompt_tokens=1,
                completion_tokens=1,
                sampling_params={},
                server="x",
            )
        )
    assert counts(fleet.enqueued()) == (5, 2, 0, 0, 3, 0)
    assert sorted(queued(redis_client)) == sorted(fleet.job_id("p", n) for n in (0, 2, 4))


def test_partition_options_choose_queue_and_sampling(fleet: Fleet, redis_client: redis.Redis):
    fleet.write_partition("B3_long", [{"prompt": "think hard"}])
    fleet.write_partition("plain", [{"prompt": "hi"}])
    (fleet.data_dir / "partitions.toml").write_text('[B3_long]\nqueue = "long"\nmax_new_tokens = 777\ntop_k = 5\n')
    fleet.producer("enqueue", "--partition", "all")
    assert queued(redis_client, "long") == [fleet.job_id("B3_long", 0)]
    assert queued(redis_client, "short") == [fleet.job_id("plain", 0)]
    params = job_kwargs(redis_client, fleet.job_id("B3_long", 0))["sampling_params"]
    assert params["max_new_tokens"] == 777 and params["top_k"] == 5


def test_bad_options_and_unknown_partitions_fail_with_one_line(fleet: Fleet):
    fleet.write_partition("p", [{"prompt": "hi"}])
    (fleet.data_dir / "partitions.toml").write_text('[p]\nqueue = "medium"\n')
    result = fleet.producer("enqueue", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "partitions.toml: [p] queue" in result.stderr

    (fleet.data_dir / "partitions.toml").unlink()
    result = fleet.producer("enqueue", "--partition", "nope", check=False)
    assert result.returncode == 2 and "unknown partition(s) nope" in result.stderr and "available: p" in result.stderr


def test_bad_setting_fails_naming_the_variable(fleet: Fleet):
    fleet.env["FLEET_SHORT_CONCURRENCY"] = "-3"
    result = fleet.producer("enqueue", check=False)
    assert result.returncode != 0
    assert "FLEET_SHORT_CONCURRENCY" in result.stderr and result.stderr.strip().count("\n") == 0


def test_a_failed_job_lost_from_the_failed_registry_is_enqueued_again(fleet: Fleet, redis_client: redis.Redis):
    fleet.write_partition("p", [{"id": n, "prompt": f"question {n}"} for n in range(3)])
    fleet.producer("enqueue")
    lost, listed = fleet.job_id("p", 0), fleet.job_id("p", 1)
    for identifier in (lost, listed):
        redis_client.lrem("rq:queue:short", 0, identifier)
        redis_client.hset(Job.key_for(identifier), "status", "failed")
    # `lost` is as RQ's own requeue leaves a job interrupted after its ZREM: failed, in no registry and no queue.
    redis_client.zadd("rq:failed:short", {listed: time.time() + 3600})

    summary = counts(fleet.enqueued())

    assert summary == (3, 0, 1, 1, 1, 0)
    assert queued(redis_client) == [fleet.job_id("p", 2), lost]
    assert redis_client.hget(Job.key_for(lost), "status") == b"queued"
    # A failed job in the registry is retry-failed's: the script itself leaves it alone too.
    keys = [Job.key_for(listed), "rq:queue:short", "rq:queues", "rq:finished:short", "rq:canceled:short"]
    keys += ["rq:failed:short", "rq:failed:long"]
    assert redis_client.register_script(ENQUEUE_SCRIPT)(keys=keys, args=[listed, "status", "queued"]) == b"failed"
    assert redis_client.hget(Job.key_for(listed), "status") == b"failed"
    assert queued(redis_client) == [fleet.job_id("p", 2), lost]


def assert_one_line_error(result: subprocess.CompletedProcess[str], *named: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.strip().count("\n") == 0, result.stderr
    assert all(text in result.stderr for text in named), result.stderr


def test_a_bad_tokenizer_fails_with_one_line(fleet: Fleet, redis_client: redis.Redis):
    fleet.write_partition("p", [{"prompt": "hi"}])
    missing = fleet.directory / "no-such-tokenizer"
    fleet.env["FLEET_TOKENIZER"] = str(missing)
    result = fleet.producer("enqueue", check=False)
    assert_one_line_error(result, f"cannot load the tokenizer FLEET_TOKENIZER={missing}")
    # A directory without a tokenizer in it.
    fleet.env["FLEET_TOKENIZER"] = str(fleet.data_dir)
    assert_one_line_error(fleet.producer("enqueue", check=False), f"FLEET_TOKENIZER={fleet.data_dir}")
    assert queued(redis_client) == []


def test_an_output_directory_that_cannot_be_written_stops_enqueue_before_any_push(
    fleet: Fleet, redis_client: redis.Redis
):
    fleet.write_partition("p", [{"prompt": "hi"}])
    (fleet.directory / "a-file").write_text("")
    output_dir = fleet.directory / "a-file" / "output"
    fleet.env["FLEET_OUTPUT_DIR"] = str(output_dir)
    assert_one_line_error(fleet.producer("enqueue", check=False), str(output_dir), "FLEET_OUTPUT_DIR")
    # The rejects report's directory, in the way of which is a file.
    fleet.env["FLEET_OUTPUT_DIR"] = str(fleet.output_dir)
    fleet.output_dir.mkdir()
    (fleet.output_dir / "rejects").write_text("")
    assert_one_line_error(fleet.producer("enqueue", check=False), str(fleet.output_dir / "rejects"))
    assert queued(redis_client) == []


def test_prompt_plus_max_new_tokens_must_leave_the_two_tokens_sglang_keeps(fleet: Fleet, redis_client: redis.Redis):
    fleet.env |= {"FLEET_CONTEXT_LENGTH": "32", "FLEET_SHORT_MAX_NEW_TOKENS": "20"}
    fleet.write_partition("p", [{"id": "fits", "input_ids": [5] * 10}, {"id": "over", "input_ids": [5] * 11}])
    summary = fleet.enqueued()
    assert (summary["enqueued"], summary["rejected"]) == (1, 1)
    [reject] = summary["rejects"]
    assert reject["sample_id"] == "over"
    assert (
        reject["reason"]
        == "11 prompt tokens + max_new_tokens 20 exceed the context length 32 less the 2 tokens SGLang keeps"
    )
