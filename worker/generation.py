"""One generation job: lock the sample, skip it if done, generate with retries, commit once."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis import Redis

from common.keys import DUPLICATES_KEY, generation_lock_key
from common.records import GenerationJob, OutputRecord
from common.settings import Settings
from common.store import OutputStore
from worker.redis_calls import call_redis
from worker.sglang import Generated, ServerDown, SGLangClient, TransientError

log = logging.getLogger(__name__)

# Renew a lease if it is ours or has lapsed (e.g. Redis lost it); never take one held by another worker.
RENEW_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    return 1
end
return 0
"""
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class Generator:
    def __init__(
        self,
        settings: Settings,
        connection: Redis,
        store: OutputStore,
        client: SGLangClient,
        owner: str,
    ) -> None:
        self.settings = settings
        self.connection = connection
        self.store = store
        self.client = client
        self.owner = owner
        self.locks: set[str] = set()
        self._renew = connection.register_script(RENEW_SCRIPT)
        self._release = connection.register_script(RELEASE_SCRIPT)

    async def run(self, job_id: str, job: GenerationJob) -> dict[str, Any]:
        """Generate and commit one sample; the return value is the RQ job's result."""
        lock = generation_lock_key(job_id)
        await self._acquire(lock)
        try:
            if await asyncio.to_thread(self.store.exists, job.partition, job_id):
                return {"committed": False, "skipped": "already committed"}
            generated = await self._generate(job)
            record = OutputRecord(
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
            )
            committed = await asyncio.to_thread(self.store.commit, record)
            if not committed:
                log.warning("discarded a duplicate output for %s", job_id)
                await call_redis(self.connection.incr, DUPLICATES_KEY)
            return {
                "committed": committed,
                "finish_reason": record.finish_reason.get("type"),
                "completion_tokens": record.completion_tokens,
            }
        finally:
            await self._release_lock(lock)

    async def _generate(self, job: GenerationJob) -> Generated:
        failures = 0
        while True:
            try:
                return await self.client.generate(job.input_ids, job.sampling_params)
            except ServerDown as error:
                # The client waits for a healthy server on the next call: no retry is spent.
                log.info("retrying after server went down: %s", error)
            except TransientError as error:
                failures += 1
                if failures >= self.settings.max_attempts:
                    raise
                delay = min(self.settings.retry_backoff * 2 ** (failures - 1), self.settings.retry_backoff_max)
                log.warning("attempt %d failed (%s); retrying in %.1fs", failures, error, delay)
                await asyncio.sleep(delay)

    async def _acquire(self, lock: str) -> None:
        """Take the sample's generation lease, waiting while another worker holds it."""
        lease_ms = self.settings.lease_ttl * 1000
        while not await call_redis(self.connection.set, lock, self.owner, nx=True, px=lease_ms):
            await asyncio.sleep(self.settings.heartbeat_interval)
        self.locks.add(lock)

    async def _release_lock(self, lock: str) -> None:
        self.locks.discard(lock)
        await call_redis(self._release, keys=[lock], args=[self.owner])

    def renew_locks(self) -> None:
        """Extend every lease this worker holds; called from the worker's heartbeat."""
        lease_ms = self.settings.lease_ttl * 1000
        with self.connection.pipeline(transaction=False) as pipeline:
            for lock in list(self.locks):
                self._renew(keys=[lock], args=[self.owner, lease_ms], client=pipeline)
            pipeline.execute()
