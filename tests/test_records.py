"""The records processes exchange through Redis and the store: what they accept, and that they round-trip."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from common.records import (
    GenerationJob,
    GenerationResult,
    OutputRecord,
    ServerMetrics,
    ServerSeen,
    Totals,
    WorkerReport,
)


@pytest.mark.parametrize("partition", ["", ".", "..", "a/b", "a\\b", "a\0b"])
def test_a_job_names_no_partition_outside_the_store(partition: str):
    with pytest.raises(ValidationError, match="not a partition name"):
        GenerationJob(partition=partition, sample_id=1, input_ids=[1], sampling_params={})


def test_a_job_needs_prompt_ids_and_nothing_else():
    with pytest.raises(ValidationError):
        GenerationJob(partition="p", sample_id=1, input_ids=[], sampling_params={})
    with pytest.raises(ValidationError):
        GenerationJob.model_validate(
            {"partition": "p", "sample_id": 1, "input_ids": [1], "sampling_params": {}, "x": 1}
        )


def test_output_record_round_trips_through_json():
    record = OutputRecord(
        id="a", partition="p", job_id="j", input_ids=[1, 2], output_ids=[3], text="t",
        finish_reason={"type": "stop", "matched": 3}, prompt_tokens=2, completion_tokens=1,
        sampling_params={"max_new_tokens": 4}, server="http://s",
    )  # fmt: skip
    assert OutputRecord.from_json(record.to_json()) == record


def test_worker_report_round_trips_and_refuses_a_report_without_heartbeat():
    report = WorkerReport(
        name="w", host="h", pid=1, queues=["short"], in_flight={"short": 2}, slots={"short": 5},
        servers=[ServerSeen(url="http://s", healthy=False, in_flight=2, down_since=1.5)], heartbeat_at=time.time(),
    )  # fmt: skip
    assert WorkerReport.model_validate_json(report.to_json()) == report
    with pytest.raises(ValidationError):
        WorkerReport.model_validate_json(b'{"name": "w"}')


def test_server_metrics_keep_what_parses_and_write_only_what_is_set():
    metrics = ServerMetrics.from_hash({b"running_req": b"7", b"token_usage": b"n/a", b"state": b"healthy", b"x": b"1"})
    assert (metrics.running_req, metrics.token_usage, metrics.state) == (7.0, None, "healthy")
    # An empty reason is written, so that a new start clears the last crash's reason.
    assert ServerMetrics.parse({"state": "starting", "reason": "", "pid": 3}).to_hash() == {
        "state": "starting",
        "reason": "",
        "pid": 3,
    }


def test_totals_and_results_read_what_workers_write():
    assert Totals.from_hash({}) == Totals()
    assert Totals.from_hash({b"samples": b"3", b"tokens": b"90", b"first_at": b"1.5"}) == Totals(
        samples=3, tokens=90, first_at=1.5
    )
    result = GenerationResult(committed=True, finish_reason="stop", completion_tokens=5)
    assert GenerationResult.model_validate(result.model_dump()) == result
