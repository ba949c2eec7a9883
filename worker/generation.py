"""One generation: skip the sample if done, generate with retries, commit once."""

from __future__ import annotations

import asyncio
import logging

from common.records import GenerationJob, GenerationResult, OutputRecord
from common.settings import Settings
from common.store import OutputStore
from worker.sglang import Generated, ServerDown, SGLangClient, TransientError

log = logging.getLogger(__name__)


class Generator:
    def __init__(
        self,
        settings: Settings,
        store: OutputStore,
        client: SGLangClient,
    ) -> None:
        self.settings = settings
        self.store = store
        self.client = client

    async def run(self, job_id: str, job: GenerationJob) -> GenerationResult:
        """Generate and commit one sample; the return value is the RQ job's result."""
        # One stat on the output filesystem: cheaper inline than a hop to a thread.
        if self.store.exists(job.partition, job_id):
            return GenerationResult(committed=False, skipped="already committed")
        generated = await self._generate(job)
        # Every field comes from validated models: skip validating them again.
        record = OutputRecord.model_construct(
            id=job.sample_id,
            partition=job.partition,
            job_id=job_id,
            input_ids=job.input_ids,
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
        committed = await asyncio.to_thread(self.store.commit, record)
        if not committed:
            # Another execution committed this sample first (the worker counts duplicates with its bookkeeping).
            log.warning("discarded a duplicate output for %s", job_id)
        return GenerationResult(
            committed=committed,
            duplicate=not committed,
            finish_reason=record.finish_reason.get("type"),
            completion_tokens=record.completion_tokens,
        )

    async def _generate(self, job: GenerationJob) -> Generated:
        failures = server_failures = 0
        while True:
            try:
                return await self.client.generate(job.input_ids, job.sampling_params)
            except ServerDown as error:
                # The client waits for a healthy server on the next call: no ordinary retry is spent. A prompt
                # that was in flight through many server crashes may be what crashes it: it gets a limit.
                server_failures += 1
                if server_failures >= self.settings.max_server_failures:
                    raise
                log.info("retrying after server went down: %s", error)
            except TransientError as error:
                failures += 1
                if failures >= self.settings.max_attempts:
                    raise
                delay = min(self.settings.retry_backoff * 2 ** (failures - 1), self.settings.retry_backoff_max)
                log.warning("attempt %d failed (%s); retrying in %.1fs", failures, error, delay)
                await asyncio.sleep(delay)
