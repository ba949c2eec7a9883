"""Which committed record is the output of an accepted prompt: the one made from the prompt as it is now.

A prompt edited since its output was made has another version, so another job ID and another record: the
old output is never paired with the new prompt. A record made before versions (its job ID has none) is
taken as the prompt's own, so that nothing generated then is lost.
"""

from __future__ import annotations

from typing import Any

from common.protocol.keys import job_id
from common.store import OutputStore
from producer.prompts import Prompt, prompt_version


def read_output(
    store: OutputStore, partition: str, prompt: Prompt, sampling_params: dict[str, Any]
) -> tuple[str, bytes | None]:
    """The job ID of the prompt's output and the record's bytes (None when there is none)."""
    current = job_id(partition, prompt.sample_id, prompt_version(prompt, sampling_params))
    data = store.read(store.sample_key(partition, current))
    if data is None:
        before = job_id(partition, prompt.sample_id)
        if (old := store.read(store.sample_key(partition, before))) is not None:
            return before, old
    return current, data
