"""The output store on local disk and on a real S3 server (SeaweedFS): one commit per sample wins, whole or never."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest

from common.records import OutputRecord
from common.store import LocalStore, ObjectStore, OutputStore
from tests.harness import SeaweedFS


def record(sample: int, text: str = "t", partition: str = "p") -> OutputRecord:
    return OutputRecord(
        id=sample, partition=partition, job_id=f"{partition}--{sample}--x", input_ids=[1, 2], output_ids=[3],
        text=text, finish_reason={"type": "stop"}, prompt_tokens=2, completion_tokens=1, sampling_params={},
        server="http://s",
    )  # fmt: skip


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.e2e)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OutputStore]:
    if request.param == "local":
        yield LocalStore(tmp_path / "output")
        return
    seaweedfs: SeaweedFS = request.getfixturevalue("seaweedfs")
    bucket = seaweedfs.bucket(f"store-{uuid.uuid4().hex[:12]}")
    yield ObjectStore(f"{bucket}/run", seaweedfs.endpoint)


def test_a_sample_is_committed_once_and_read_back_whole(store: OutputStore):
    assert store.problem() is None
    first = record(1, "first")
    assert store.commit(first) is True
    assert store.commit(record(1, "second")) is False
    assert store.load("p", first.job_id) == first and store.has("p", first.job_id)
    assert store.load("p", "p--2--x") is None and not store.has("p", "p--2--x")
    store.commit(record(2, partition="q"))
    assert store.done("p") == {first.job_id} and store.partitions() == ["p", "q"]
    store.replace("rejects/p.jsonl", b"one")
    store.replace("rejects/p.jsonl", b"two")
    assert store.read("rejects/p.jsonl") == b"two" and store.read("rejects/none.jsonl") is None


def test_prompts_are_written_once_per_batch_and_read_by_reference(store: OutputStore):
    batch = [[1, 2, 3], [70_000, 5], [2**32 - 1]]
    refs = store.write_prompts("p", batch)
    assert [store.read_prompt(ref) for ref in refs] == batch
    assert store.write_prompts("p", batch) == refs  # the same content is the same object
    assert len(list(store.keys("prompts"))) == 1
    with pytest.raises(FileNotFoundError):
        store.read_prompt(refs[0].model_copy(update={"key": "prompts/p/gone.u32"}))


def test_concurrent_commits_of_one_sample_leave_exactly_one_winner_with_its_own_body(store: OutputStore):
    for round_number in range(10):
        sample, writers = 100 + round_number, 8
        barrier = threading.Barrier(writers)
        won: list[str] = []

        def commit(
            writer: int, sample: int = sample, barrier: threading.Barrier = barrier, won: list[str] = won
        ) -> None:
            barrier.wait()
            if store.commit(record(sample, f"writer {writer}")):
                won.append(f"writer {writer}")

        threads = [threading.Thread(target=commit, args=(writer,)) for writer in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(won) == 1
        assert store.load("p", f"p--{sample}--x").text == won[0]


def test_a_record_cut_off_mid_write_is_never_visible(store: OutputStore):
    key = store.sample_key("p", "p--9--x")
    if isinstance(store, LocalStore):
        # A process killed between writing its temporary file and linking it leaves only the dotfile.
        store._make_dirs(store.path(key).parent)
        store._write_temporary(store.path(key), record(9).to_json()[:20])
    else:
        # An upload whose body fails half way, as a killed process's would.
        def body() -> Iterator[bytes]:
            yield record(9).to_json()[:20]
            raise ConnectionError("the writer died")

        with pytest.raises(Exception, match="the writer died"):
            obstore.put(store.store, key, body(), mode="create")
    assert store.read(key) is None and store.done("p") == set()
    assert store.commit(record(9)) is True


def test_a_filesystem_without_hard_links_is_refused_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def no_links(source: object, target: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("common.store.local.os.link", no_links)
    problem = LocalStore(tmp_path / "fuse").problem()
    assert problem is not None and "Operation not permitted" in problem and "FLEET_OUTPUT_DIR=s3://" in problem


def test_temporary_files_are_never_listed_and_those_left_by_killed_writers_are_removed(tmp_path: Path):
    store = LocalStore(tmp_path)
    store.commit(record(1))
    temporaries = tmp_path / ".tmp"
    left, writing = temporaries / "p--2--x.json.4242.0a1b", temporaries / "p--3--x.json.4243.0c2d"
    for path in (left, writing):
        path.write_bytes(b'{"half a rec')
    day_ago = time.time() - 86_400
    os.utime(left, (day_ago, day_ago))

    assert store.done("p") == {"p--1--x"} and store.partitions() == ["p"] and ".tmp" not in store.folders("")
    assert list(store.keys("")) == [store.sample_key("p", "p--1--x")]
    assert store.remove_leftovers() == 1
    assert not left.exists() and writing.exists()
