"""The SGLang simulator, run as its own process: SGLang's shapes, determinism, the running cap, the fault flags."""

from __future__ import annotations

import asyncio
import hashlib
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from tests.harness import ROOT, Simulator, wait_until

StartSimulator = Callable[..., Simulator]
TOKENIZER = AutoTokenizer.from_pretrained(ROOT / "sample" / "tokenizer")
GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput")


def generate(simulator: Simulator, body: dict[str, Any], timeout: float = 10, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{simulator.url}/generate", json=body, timeout=timeout, **kwargs)


def get(simulator: Simulator, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(f"{simulator.url}{path}", timeout=10, **kwargs)


def test_same_request_same_answer_and_other_sampling_params_another(start_simulator: StartSimulator) -> None:
    simulator = start_simulator()
    body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.7, "max_new_tokens": 64}}
    first, second = generate(simulator, body).json(), generate(simulator, body).json()
    assert first["output_ids"] == second["output_ids"]
    assert first["text"] == second["text"]
    assert first["meta_info"]["id"] != second["meta_info"]["id"]
    other = generate(simulator, {**body, "sampling_params": {"temperature": 0.3, "max_new_tokens": 64}}).json()
    assert other["output_ids"] != first["output_ids"]
    assert all(0 <= token < len(TOKENIZER) for token in first["output_ids"])
    digest = hashlib.sha1(orjson.dumps([5, 6, 7])).hexdigest()
    assert simulator.stats()["inputs"] == {digest: 3}


def test_answers_end_with_the_tokenizers_end_token_trimmed_from_text_as_sglang_does(
    start_simulator: StartSimulator,
) -> None:
    simulator = start_simulator("--min-output-tokens", "5", "--max-output-tokens", "5")
    params = {"max_new_tokens": 100, "skip_special_tokens": False}
    stop = generate(simulator, {"input_ids": [1, 2, 3], "sampling_params": params}).json()
    end = TOKENIZER.eos_token_id
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": end}
    assert stop["output_ids"][-1] == end and end not in stop["output_ids"][:-1]
    assert stop["meta_info"]["completion_tokens"] == len(stop["output_ids"]) > 5
    assert stop["meta_info"]["prompt_tokens"] == 3
    # SGLang's detokenizer trims the matched stop token from `text`, not from `output_ids`.
    assert stop["text"] == TOKENIZER.decode(stop["output_ids"][:-1], skip_special_tokens=False)
    kept = generate(simulator, {"input_ids": [1, 2, 3], "sampling_params": {**params, "no_stop_trim": True}}).json()
    assert kept["text"] == stop["text"] + TOKENIZER.eos_token

    hidden = generate(simulator, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 100}}).json()
    assert hidden["output_ids"] == stop["output_ids"]
    assert hidden["text"] == TOKENIZER.decode(stop["output_ids"][:-1], skip_special_tokens=True)

    length = generate(simulator, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}}).json()
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert length["output_ids"] == stop["output_ids"][:3]
    assert length["meta_info"]["completion_tokens"] == 3

    default = generate(simulator, {"input_ids": [1, 2, 3], "sampling_params": {"ignore_eos": True}}).json()
    assert default["meta_info"]["finish_reason"] == {"type": "length", "length": 128}  # SGLang's default
    assert end not in default["output_ids"]


def test_max_new_tokens_is_cut_to_what_the_context_leaves(start_simulator: StartSimulator) -> None:
    simulator = start_simulator("--context-length", "64")
    body = {"input_ids": list(range(10)), "sampling_params": {"max_new_tokens": 54, "ignore_eos": True}}
    answer = generate(simulator, body).json()
    # SGLang's scheduler keeps one token for the request and one more: context - 1 - prompt - 1.
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 52}
    assert len(answer["output_ids"]) == 52


def test_generations_use_the_templates_reasoning_and_tool_call_markers(start_simulator: StartSimulator) -> None:
    simulator = start_simulator("--min-output-tokens", "4", "--max-output-tokens", "12")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    offered = TOKENIZER.apply_chat_template(messages, tools=[weather], add_generation_prompt=True, return_dict=True)
    plain = TOKENIZER.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    params = {"max_new_tokens": 200, "skip_special_tokens": False}

    def texts(prompt: list[int]) -> list[str]:
        seeds = [{**params, "temperature": 0.01 * n} for n in range(1, 31)]
        answers = generate(simulator, {"input_ids": [prompt] * 30, "sampling_params": seeds}).json()
        return [answer["text"] for answer in answers]

    with_tools, without = texts(offered["input_ids"]), texts(plain["input_ids"])
    calls = [re.search(r"<tool_call>\n(.*)\n</tool_call>$", text) for text in with_tools]
    assert 5 < sum(call is not None for call in calls) < 30
    assert {orjson.loads(call.group(1))["name"] for call in calls if call} == {"get_weather"}
    assert not any("<tool_call>" in text for text in without)
    reasoned = [text for text in with_tools + without if text.startswith("<think>\n")]
    assert 20 < len(reasoned) < 60 and all("\n</think>\n\n" in text for text in reasoned)


def test_a_template_without_markers_gets_plain_answers(start_simulator: StartSimulator, tmp_path: Path) -> None:
    plain = tmp_path / "tokenizer"
    shutil.copytree(ROOT / "sample" / "tokenizer", plain)
    config = orjson.loads((plain / "tokenizer_config.json").read_bytes())
    config["chat_template"] = "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    (plain / "tokenizer_config.json").write_bytes(orjson.dumps(config))
    simulator = start_simulator("--tokenizer-path", str(plain))
    bodies = [{"input_ids": [n, 9], "sampling_params": {"skip_special_tokens": False}} for n in range(20)]
    texts = [generate(simulator, body).json()["text"] for body in bodies]
    assert not any("<think>" in text or "<tool_call>" in text for text in texts)
    assert get(simulator, "/server_info").json()["tokenizer_path"] == str(plain)


def test_batch_form_answers_a_list_like_single_requests(start_simulator: StartSimulator) -> None:
    simulator = start_simulator()
    params = {"max_new_tokens": 32, "temperature": 0.5}
    batch = generate(simulator, {"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": params}).json()
    singles = [generate(simulator, {"input_ids": ids, "sampling_params": params}).json() for ids in ([1, 2], [3, 4, 5])]
    assert [item["output_ids"] for item in batch] == [single["output_ids"] for single in singles]

    per_item = [params, {**params, "max_new_tokens": 2}]
    mixed = generate(simulator, {"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": per_item}).json()
    assert mixed[0]["output_ids"] == batch[0]["output_ids"]
    assert mixed[1]["output_ids"] == batch[1]["output_ids"][:2]

    texts = generate(simulator, {"text": ["hello there", "general"], "sampling_params": params}).json()
    assert [item["meta_info"]["prompt_tokens"] for item in texts] == [
        len(TOKENIZER.encode(text)) for text in ("hello there", "general")
    ]
    assert all(item["text"] for item in texts)


def test_refusals_have_sglang_status_and_body(start_simulator: StartSimulator) -> None:
    simulator = start_simulator("--context-length", "64")
    unknown = generate(simulator, {"input_ids": [1], "sampling_params": {"max_tokens": 5}})
    assert unknown.status_code == 400
    assert unknown.json()["error"].startswith("unknown field `max_tokens`, expected one of `max_new_tokens`, ")

    mistyped = generate(simulator, {"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}})
    assert mistyped.status_code == 400
    assert mistyped.json() == {"error": 'invalid type: string "8", expected i64'}

    too_long = generate(simulator, {"input_ids": list(range(64))})
    assert too_long.status_code == 400
    assert too_long.json() == {
        "error": {"message": "The input (64 tokens) is longer than the model's context length (64 tokens)."}
    }

    over_budget = generate(simulator, {"input_ids": list(range(10)), "sampling_params": {"max_new_tokens": 60}})
    assert over_budget.status_code == 400
    assert "exceeds the model's maximum context length of 64 tokens" in over_budget.json()["error"]["message"]

    stats = simulator.stats()
    assert (stats["requests"], stats["errors"], stats["completed"], stats["inputs"]) == (4, 4, 0, {})


def test_abort_rate_answers_200_with_part_of_the_output(start_simulator: StartSimulator) -> None:
    simulator = start_simulator("--abort-rate", "1", "--min-output-tokens", "10", "--max-output-tokens", "10")
    response = generate(simulator, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 50}})
    assert response.status_code == 200
    output = response.json()
    assert output["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(output["output_ids"]) < 11
    assert output["meta_info"]["completion_tokens"] == len(output["output_ids"])
    assert simulator.stats()["aborted"] == 1


def test_error_rate_answers_503(start_simulator: StartSimulator) -> None:
    simulator = start_simulator("--error-rate", "1")
    response = generate(simulator, {"input_ids": [1, 2, 3]})
    assert response.status_code == 503
    assert response.json()["code"] == 503
    assert simulator.stats()["errors"] == 1


def test_exit_after_kills_the_process_and_drops_requests_in_flight(start_simulator: StartSimulator) -> None:
    simulator = start_simulator("--exit-after", "2", "--token-latency", "0.01")
    endless = {"input_ids": [1], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}  # 30 s
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(generate, simulator, endless, 60)
        wait_until(lambda: simulator.stats()["running"] == 1, timeout=10, what="the long request to run")
        for prompt in ([2], [3]):
            assert (
                generate(simulator, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}).status_code == 200
            )
        assert simulator.wait(timeout=10) != 0
        with pytest.raises(httpx.TransportError):
            in_flight.result(timeout=10)


def test_hang_leaves_generate_unanswered_while_health_answers(start_simulator: StartSimulator) -> None:
    simulator = start_simulator("--hang")
    with pytest.raises(httpx.ReadTimeout):
        generate(simulator, {"input_ids": [1, 2, 3]}, timeout=0.5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(f"{simulator.url}/health_generate", timeout=0.5)
    assert get(simulator, "/health").status_code == 200
    assert simulator.stats()["requests"] == 1


def test_max_running_caps_running_requests_and_queues_the_rest(start_simulator: StartSimulator) -> None:
    args = ("--max-running", "50", "--token-latency", "0.02", "--min-output-tokens", "10", "--max-output-tokens", "10")
    simulator = start_simulator(*args)

    async def burst(count: int) -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(base_url=simulator.url, timeout=30, limits=limits) as client:
            bodies = [{"input_ids": [i, i + 1], "sampling_params": {"max_new_tokens": 64}} for i in range(count)]
            return await asyncio.gather(*(client.post("/generate", json=body) for body in bodies))

    responses = asyncio.run(burst(200))
    assert [response.status_code for response in responses] == [200] * 200
    stats = simulator.stats()
    assert stats["peak_running"] == 50
    assert stats["peak_in_flight"] > 50
    assert (stats["completed"], stats["running"], stats["queued"]) == (200, 0, 0)


def test_a_client_that_gives_up_frees_its_slot(start_simulator: StartSimulator) -> None:
    simulator = start_simulator("--max-running", "1", "--token-latency", "0.05")
    endless = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}  # 50 s
    with pytest.raises(httpx.ReadTimeout):
        generate(simulator, endless, timeout=0.5)
    wait_until(lambda: simulator.stats()["disconnected"] == 1, timeout=10, what="the abandoned request to end")
    assert simulator.stats()["running"] == 0
    assert generate(simulator, {"input_ids": [2], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_api_key_guards_all_but_health_and_metrics(start_simulator: StartSimulator) -> None:
    simulator = start_simulator("--api-key", "sekret")
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    missing = generate(simulator, body)
    assert missing.status_code == 401
    assert missing.json() == {"error": "Unauthorized"}
    assert generate(simulator, body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert generate(simulator, body, headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert get(simulator, "/server_info").status_code == 401
    for path in ("/health", "/health_generate", "/metrics"):
        assert get(simulator, path).status_code == 200


def test_info_endpoints_and_metrics(start_simulator: StartSimulator) -> None:
    simulator = start_simulator("--max-running", "7", "--context-length", "4096")
    for path in ("/server_info", "/get_server_info"):
        info = get(simulator, path).json()
        assert info["model_path"] == "simulated-model"
        assert (info["context_length"], info["max_running_requests"]) == (4096, 7)
        assert info["max_total_num_tokens"] > 0
        assert info["version"] == "simulator"
    for path in ("/model_info", "/get_model_info"):
        assert get(simulator, path).json()["is_generation"] is True
    assert get(simulator, "/health_generate").status_code == 200

    generate(simulator, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
    metrics = get(simulator, "/metrics").text
    for name in GAUGES:
        assert f'{name}{{model_name="simulated-model",' in metrics
    counter_labels = '{model_name="simulated-model",engine_type="unified",is_streaming="false"}'
    assert f"sglang:prompt_tokens_total{counter_labels} 3.0" in metrics
    assert f"sglang:num_requests_total{counter_labels} 1.0" in metrics
