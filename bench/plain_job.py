"""The job a plain RQ worker runs in bench/memory.py: one blocking `/generate` call, as a forked horse does."""

from __future__ import annotations

import httpx


def generate(url: str, input_ids: list[int]) -> int:
    payload = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 400, "skip_special_tokens": False}}
    response = httpx.post(f"{url}/generate", json=payload, timeout=None)
    return len(response.json()["output_ids"])
