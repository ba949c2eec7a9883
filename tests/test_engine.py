"""The simulator's engine in process: answers from the tokenizer's vocabulary, ended and trimmed as SGLang does."""

from __future__ import annotations

import pytest

from server.simulator.contract import Prompt, Refused, check_length, parse_generate
from server.simulator.engine import Model
from tests.harness import ROOT


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(str(ROOT / "sample" / "tokenizer"), context_length=64, lengths=(4, 12), seed=0)


def test_answers_are_deterministic_end_with_the_end_token_and_hide_it_from_text(model: Model):
    prompt = Prompt("r", [1, 2, 3], {"max_new_tokens": 40, "skip_special_tokens": False})
    first, again = model.generate(prompt), model.generate(prompt)
    assert first == again
    assert first.output_ids[-1] == model.eos and first.finish_reason == {"type": "stop", "matched": model.eos}
    assert first.text == model.tokenizer.decode(first.output_ids[:-1], skip_special_tokens=False)
    kept = model.generate(Prompt("r", [1, 2, 3], {**prompt.params, "no_stop_trim": True}))
    assert kept.text == first.text + "<|im_end|>"
    cut = model.generate(Prompt("r", [1, 2, 3], {**prompt.params, "max_new_tokens": 2}))
    assert cut.output_ids == first.output_ids[:2] and cut.finish_reason == {"type": "length", "length": 2}


def test_max_new_tokens_leaves_room_for_the_context_and_ignore_eos_runs_to_it(model: Model):
    answer = model.generate(Prompt("r", list(range(10)), {"max_new_tokens": 100, "ignore_eos": True}))
    assert answer.finish_reason == {"type": "length", "length": 52} and model.eos not in answer.output_ids


def test_the_contract_refuses_what_sglang_refuses(model: Model):
    with pytest.raises(Refused) as refused:
        parse_generate({"input_ids": [1], "sampling_params": {"max_tokens": 3}}, model.encode)
    assert refused.value.body["error"].startswith("unknown field `max_tokens`")
    [prompt], single = parse_generate({"text": "hello there"}, model.encode)
    assert single and prompt.input_ids == model.encode("hello there")
    with pytest.raises(Refused, match="longer than the model's context length"):
        check_length(Prompt("r", list(range(64)), {}), 64)
