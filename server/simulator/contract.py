"""SGLang's `/generate` request contract: the shapes it accepts and the 400s it answers otherwise.

Shapes follow SGLang 0.5.23 (`pip download sglang`; paths under python/sglang/srt/ unless noted):
- entrypoints/api_contract.py and python/sglang/api/v1/api_types.py: the contract gate refuses an unknown or
  mistyped sampling key with `400 {"error": "unknown field `max_tokens`, expected one of ..."}` (a string).
- managers/io_struct.py (GenerateReqInput): single or batch form, `text` winning over `input_ids`.
- sampling/sampling_params.py: the keys, max_new_tokens 128, verify()'s messages.
- managers/tokenizer_manager.py `_validate_one_request`: the context-length checks (no auto-truncation).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# SamplingParams' keys, in the order SGLang lists them when it refuses an unknown one.
SAMPLING_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
# The JSON type of each scalar key, named as SGLang's schema gate names it in its refusals.
SCALAR_TYPES = {
    **dict.fromkeys(
        ["max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval", "sampling_seed", "beam_width"], "i64"
    ),
    **dict.fromkeys(
        ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"], "f64"
    ),
    **dict.fromkeys(
        ["ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"], "a boolean"
    ),
}
DEFAULT_MAX_NEW_TOKENS = 128


class Refused(Exception):
    """A request SGLang turns down with a 400; `body` is what it answers."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.body = body


def contract_error(message: str) -> Refused:
    """The schema gate's refusal: the error is a bare string."""
    return Refused({"error": message})


def value_error(message: str) -> Refused:
    """A ValueError from the tokenizer manager or SamplingParams.verify()."""
    return Refused({"error": {"message": message}})


def describe(value: Any) -> str:
    """A JSON value as serde's `Unexpected` shows it, which SGLang's schema gate copies."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def has_type(value: Any, expected: str) -> bool:
    if expected == "a boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if expected == "i64" else isinstance(value, int | float)


def invalid_type(value: Any, expected: str) -> Refused:
    return contract_error(f"invalid type: {describe(value)}, expected {expected}")


def check_sampling_params(params: Any) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise invalid_type(params, "struct SamplingParams")
    for key, value in params.items():
        if key not in SAMPLING_KEYS:
            expected = ", ".join(f"`{name}`" for name in SAMPLING_KEYS)
            raise contract_error(f"unknown field `{key}`, expected one of {expected}")
        if value is None:
            continue  # null means the default
        if key in SCALAR_TYPES and not has_type(value, SCALAR_TYPES[key]):
            raise invalid_type(value, SCALAR_TYPES[key])
        if key == "stop_token_ids":
            if not isinstance(value, list):
                raise invalid_type(value, "a sequence")
            for token in value:
                if not has_type(token, "i64"):
                    raise invalid_type(token, "i64")
    return params


def verify_sampling_params(params: dict[str, Any]) -> None:
    """The checks of SGLang's SamplingParams.verify() for the keys the simulation reads."""
    temperature = params.get("temperature")
    if temperature is not None and temperature < 0:
        raise value_error(f"temperature must be a non-negative finite number, got {float(temperature)}.")
    top_p = params.get("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise value_error(f"top_p must be in (0, 1], got {float(top_p)}.")
    min_new = params.get("min_new_tokens") or 0
    if min_new < 0:
        raise value_error(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is not None and max_new < 0:
        raise value_error(f"max_new_tokens must be at least 0, got {max_new}.")
    if max_new is not None and min_new > max_new:
        raise value_error(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    if (params.get("n") or 1) != 1:
        raise value_error("The SGLang simulator does not support n > 1.")


@dataclass
class Prompt:
    rid: str
    input_ids: list[int]
    params: dict[str, Any]


def parse_generate(body: Any, encode: Callable[[str], list[int]]) -> tuple[list[Prompt], bool]:
    """The prompts of a /generate body and whether it was the single form, or Refused; `encode` tokenizes text."""
    if not isinstance(body, dict):
        raise invalid_type(body, "struct GenerateRequest")
    if body.get("stream"):
        raise value_error("The SGLang simulator does not stream; send stream=false.")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None:
        if not isinstance(text, str | list):
            raise invalid_type(text, "a value or an array of values for StringOrList")
        single = isinstance(text, str)
        for item in [] if single else text:
            if not isinstance(item, str):
                raise invalid_type(item, "a string")
        batch = [encode(item) for item in ([text] if single else text)]
    elif input_ids is not None:
        if not isinstance(input_ids, list):
            raise invalid_type(input_ids, "a value or an array of values for TokenIdsOrList")
        if not input_ids:
            raise value_error("input_ids cannot be empty.")
        single = not isinstance(input_ids[0], list)
        batch = [input_ids] if single else input_ids
        for ids in batch:
            if not isinstance(ids, list):
                raise invalid_type(ids, "a sequence")
            for token in ids:
                if not has_type(token, "i64"):
                    raise invalid_type(token, "i64")
    else:
        raise value_error("Either text, input_ids or input_embeds should be provided.")

    params = body.get("sampling_params") or {}
    if isinstance(params, list):
        param_list = [check_sampling_params(item) for item in params]
        if len(param_list) != len(batch):
            raise value_error("The length of sampling_params should be equal to the batch size.")
    else:
        param_list = [check_sampling_params(params)] * len(batch)
    for item in param_list:
        verify_sampling_params(item)

    rid = body.get("rid")
    if single:
        rids = [rid if isinstance(rid, str) else uuid.uuid4().hex]
    elif isinstance(rid, list):
        if len(rid) != len(batch):
            raise value_error("The specified rids length mismatch with the batch_size for batch processing.")
        rids = [str(item) for item in rid]
    else:
        rids = [f"{rid}_{i}" if isinstance(rid, str) else uuid.uuid4().hex for i in range(len(batch))]
    return [Prompt(*fields) for fields in zip(rids, batch, param_list, strict=True)], single


def check_length(prompt: Prompt, context_length: int) -> None:
    """SGLang's TokenizerManager._validate_one_request, without auto-truncation."""
    input_tokens = len(prompt.input_ids)
    if input_tokens >= context_length:
        raise value_error(
            f"The input ({input_tokens} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    max_new = prompt.params.get("max_new_tokens")  # SGLang checks only an explicit one
    if max_new is not None and input_tokens + max_new > context_length:
        raise value_error(
            f"Requested token count exceeds the model's maximum context length of {context_length} "
            f"tokens. You requested a total of {input_tokens + max_new} tokens: {input_tokens} tokens "
            f"from the input messages and {max_new} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )
