"""`verify` on real outputs: a clean run passes; each kind of damage is caught and named."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from common.settings import get_settings
from common.store import LocalStore
from producer.__main__ import main
from tests.harness import ROOT, Fleet, Simulator

Start = Callable[..., Simulator]
Verify = Callable[..., tuple[int, str]]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture
def verify(fleet: Fleet, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Verify]:
    """`python -m producer verify ARGS` in this process, with the fleet's settings (and `env`): (exit code, output)."""

    def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
        for key, value in (fleet.env | (env or {})).items():
            if key.startswith("FLEET_"):
                monkeypatch.setenv(key, value)
        get_settings.cache_clear()
        code = main(["verify", *args])
        return code, capsys.readouterr().out

    yield run
    get_settings.cache_clear()


def altered_tokenizer(directory: Path) -> Path:
    """The sample tokenizer with one character of its chat template changed."""
    copy = directory / "tokenizer"
    shutil.copytree(ROOT / "sample" / "tokenizer", copy)
    config_path = copy / "tokenizer_config.json"
    config = orjson.loads(config_path.read_bytes())
    config["chat_template"] = config["chat_template"].replace("{{ message.role }}\n", "{{ message.role }}:\n")
    config_path.write_bytes(orjson.dumps(config))
    return copy


def test_a_bad_tokenizer_fails_with_one_line(fleet: Fleet):
    fleet.write_partition("p", [{"prompt": "hi"}])
    missing = fleet.directory / "no-such-tokenizer"
    fleet.env["FLEET_TOKENIZER"] = str(missing)

    result = fleet.producer("verify", check=False)

    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"error: cannot load the tokenizer FLEET_TOKENIZER={missing}: " in result.stderr


def test_verify_passes_a_clean_run_and_names_each_kind_of_damage(
    fleet: Fleet, start_simulator: Start, verify: Verify, tmp_path: Path
):
    fleet.point_at(start_simulator("--min-output-tokens", "8", "--max-output-tokens", "16"))
    weather = {"id": "w", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER]}
    fleet.write_partition("p", [*({"id": f"p-{n}", "prompt": f"Question {n}?"} for n in range(6)), weather])
    fleet.write_partition("cut", [{"id": "c-0", "prompt": "Tell me everything."}])
    (fleet.data_dir / "partitions.toml").write_text("[cut]\nmax_new_tokens = 4\n")
    fleet.producer("enqueue")
    assert fleet.start_worker("--burst").wait(timeout=60) == 0
    export = fleet.directory / "export"
    fleet.producer("export", "--out", str(export))

    result = fleet.producer("verify", "--export", str(export))
    output = result.stdout
    assert "verify: all good, 8 outputs of 2 partitions" in output
    assert "outputs cut at max_new_tokens (finish_reason length) (1):\n    cut: 'c-0' (4 tokens)" in output

    store = LocalStore(fleet.output_dir)
    victim = store.path(store.sample_key("p", fleet.job_id("p", "p-3")))
    record = victim.read_bytes()

    victim.unlink()
    code, output = verify("--partition", "p")
    assert code == 1 and "accepted prompts without an output (1):\n    p: 'p-3' (line 4)" in output
    victim.write_bytes(record)

    # The same sample under a second name, as a copy made outside the store would leave it.
    copy = victim.with_name("p--p-3-copy.json")
    copy.write_bytes(record)
    code, output = verify("--partition", "p")
    assert code == 1 and "samples held by more than one file (1):\n    p: p/p-3 is in 2 files" in output
    assert f"{copy}: holds p/'p-3'" in output
    copy.unlink()

    # Sampling parameters changed mid-run.
    changed = orjson.loads(record)
    changed["sampling_params"]["temperature"] = 1.0
    victim.write_bytes(orjson.dumps(changed))
    code, output = verify("--partition", "p")
    assert code == 1 and "partitions mixing sampling parameters (1):\n    p: 6 made with" in output

    # A record made by another model.
    changed = orjson.loads(record) | {"model": "another-model"}
    victim.write_bytes(orjson.dumps(changed))
    code, output = verify("--partition", "p")
    assert code == 1 and "partitions mixing outputs of different models (1):" in output
    assert "simulated-model (6), another-model (1)" in output
    victim.write_bytes(record)

    code, output = verify("--export", str(export), env={"FLEET_TOKENIZER": str(altered_tokenizer(tmp_path))})
    assert code == 1
    assert "outputs whose input_ids differ from what the tokenizer and template make now (8):" in output
    assert "exported with another tokenizer" in output

    with open(export / "p.jsonl", "ab") as file:
        file.write((export / "p.jsonl").read_bytes().splitlines()[0] + b"\n")
    code, output = verify("--export", str(export))
    assert code == 1 and "p.jsonl: id 'p-0' appears 2 times" in output
    assert "manifest says 7 records, p.jsonl has 8" in output and "changed since it was exported" in output

    assert verify()[0] == 0  # the store itself is whole again


def test_an_edited_partition_is_generated_again_and_never_paired_with_old_outputs(
    fleet: Fleet, start_simulator: Start, verify: Verify
):
    fleet.point_at(start_simulator())
    questions = [{"prompt": f"Question {n}?"} for n in range(4)]
    fleet.write_partition("p", questions)  # ids are line numbers
    fleet.producer("enqueue")
    assert fleet.start_worker("--burst").wait(timeout=60) == 0
    # A line inserted at the top: every id now names another prompt.
    fleet.write_partition("p", [{"prompt": "A new first question?"}, *questions])

    summary = fleet.enqueued()

    assert (summary["total"], summary["done"], summary["changed"], summary["enqueued"]) == (5, 0, 4, 5)
    assert fleet.start_worker("--burst").wait(timeout=60) == 0
    export = fleet.directory / "export"
    fleet.producer("export", "--out", str(export), "--format", "sharegpt", "--strict")
    rows = [orjson.loads(line) for line in (export / "p.jsonl").read_bytes().splitlines()]
    assert [row["conversations"][0]["content"] for row in rows] == ["A new first question?"] + [
        f"Question {n}?" for n in range(4)
    ]
    code, output = verify("--export", str(export))
    # Every exported row is the generation of its prompt as it is now; the old outputs are only noted.
    assert code == 0 and "input_ids differ" not in output
    assert (
        "outputs of an earlier version of a prompt, edited since (not exported; enqueue generates the new) (4):"
        in output
    )
    # Changing the sampling parameters is an edit too.
    (fleet.data_dir / "partitions.toml").write_text("[p]\ntemperature = 0.9\n")
    assert fleet.enqueued()["changed"] == 5


def test_a_failed_prompt_fixed_in_the_partition_replaces_its_failed_job(fleet: Fleet, start_simulator: Start):
    fleet.point_at(start_simulator("--context-length", "60"))
    fleet.env["FLEET_SHORT_MAX_NEW_TOKENS"] = "16"
    too_long = {"id": "q", "input_ids": [5] * 80}  # the server answers HTTP 400
    fleet.write_partition("p", [{"id": "a", "input_ids": [5] * 10}, too_long])
    fleet.producer("enqueue")
    assert fleet.start_worker("--burst").wait(timeout=60) == 0
    assert fleet.enqueued()["failed"] == 1
    fleet.write_partition("p", [{"id": "a", "input_ids": [5] * 10}, {**too_long, "input_ids": [5] * 20}])

    summary = fleet.enqueued()
    screen = fleet.producer("enqueue").stdout

    # The failed job of the old prompt is gone: retry-failed cannot run it again, status does not count it.
    assert (summary["failed"], summary["superseded"], summary["enqueued"]) == (0, 1, 1)
    assert "superseded" not in screen  # the second run finds nothing more to delete
    assert fleet.start_worker("--burst").wait(timeout=60) == 0
    assert fleet.producer_json("status", "--json")["partitions"]["p"]["failed"] == 0
    assert fleet.producer("retry-failed").stdout.startswith("requeued 0 failed jobs")
    assert sorted(record["input_ids"] for record in fleet.outputs("p")) == [[5] * 10, [5] * 20]
