"""One generation: skip the sample if done, read its prompt, generate with retries, commit once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from common.records import GenerationJob, GenerationResult, OutputRecord
from common.settings import Settings
from common.store import OutputStore, StoreError
from worker.sglang import Busy, Generated, ServerDown, SGLangClient, TransientError

log = logging.getLogger(__name__)
T = TypeVar("T")


class PromptMissing(Exception):
    """The job's prompt is not in the output store (deleted, or another store configured): it cannot run."""


class Generator:
    def __init__(
        self,
        settings: Settings,
        store: OutputStore,
        client: SGLangClient,
        max_server_failures: int | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.client = client
        # A FleetWorker takes the first failure out of the generation: its job goes to probation.
        self.max_server_failures = max_server_failures or settings.max_server_failures

    async def run(self, job_id: str, job: GenerationJob) -> GenerationResult:
        """Generate and commit one sample; the return value is the RQ job's result."""
        if await self._patiently(self.store.has, job.partition, job_id):
            return GenerationResult(committed=False, skipped="already committed")
        input_ids = job.input_ids
        if job.prompt is not None:
            try:
                input_ids = await self._patiently(self.store.read_prompt, job.prompt)
            except FileNotFoundError as error:
                raise PromptMissing(
                    f"the prompt's ids are gone from {self.store.location}/{job.prompt.key}: run enqueue again"
                ) from error
        generated = await self._generate(input_ids, job.sampling_params)
        # Every field comes from validated models: skip validating them again.
        record = OutputRecord.model_construct(
            id=job.sample_id,
            partition=job.partition,
            job_id=job_id,
            version=job.version,
            input_ids=input_ids,
            output_ids=generated.output_ids,
            text=generated.text,
            finish_reason=generated.meta_info.finish_reason,
            prompt_tokens=generated.meta_info.prompt_tokens,
            completion_tokens=generated.meta_info.completion_tokens,
            cached_tokens=generated.meta_info.cached_tokens,
            sampling_params=job.sampling_params,
            server=generated.server,
            model=generated.model,
            server_version=generated.server_version,
        )
        committed = await self._patiently(self.store.commit, record)
        if not committed:
            # Another execution committed this sample first (the worker counts duplicates with its bookkeeping).
            log.warning("discarded a duplicate output for %s", job_id)
        return GenerationResult(
            committed=committed,
            duplicate=not committed,
            finish_reason=record.finish_reason.get("type"),
            completion_tokens=record.completion_tokens,
        )

    async def _patiently(self, call: Callable[..., T], *args: Any) -> T:
        """A store call in a thread, retried while the store is unreachable: a finished generation must be kept."""
        delay = self.settings.retry_backoff
        while True:
            try:
                return await asyncio.to_thread(call, *args)
            except StoreError as error:
                log.warning("output store unavailable (%s); retrying in %.1fs", error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_backoff_max)

    async def _generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Generated:
        failures = server_failures = turned_away = 0
        while True:
            try:
                return await self.client.generate(input_ids, sampling_params)
            except Busy as error:
                # Turned away for now (a full queue): wait and send again, at no cost to the job's attempts.
                turned_away += 1
                backoff = min(self.settings.retry_backoff * 2 ** (turned_away - 1), self.settings.retry_backoff_max)
                delay = error.retry_after if error.retry_after is not None else backoff
                log.info("turned away (%s); sending again in %.1fs", error, delay)
                await asyncio.sleep(delay)
            except ServerDown as error:
                # The client waits for a healthy server on the next call: no ordinary retry is spent. A prompt
                # that was in flight through many server crashes may be what crashes it: it gets a limit.
                server_failures += 1
                if server_failures >= self.max_server_failures:
                    raise
                log.info("retrying after server went down: %s", error)
            except TransientError as error:
                failures += 1
                if failures >= self.settings.max_attempts:
                    raise
                delay = min(self.settings.retry_backoff * 2 ** (failures - 1), self.settings.retry_backoff_max)
                log.warning("attempt %d failed (%s); retrying in %.1fs", failures, error, delay)
                await asyncio.sleep(delay)
