"""Turning partitions into RQ jobs, idempotently: one queued job per pending prompt, however often run.

RQ's own enqueue is not enough here: enqueueing an existing job ID pushes it again (so it runs
twice), `unique=True` keeps refusing a failed job's ID, and `enqueue_many` ignores `unique`. So each
job is created and pushed by one Lua script that first looks at the job's status in the same atomic
step: two producers running at once cannot both push a job.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from redis import Redis
from rq import Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import FailedJobRegistry
from tqdm import tqdm

from common.protocol import scripts
from common.protocol.keys import (
    DESCRIPTION_PREFIX,
    JOB_FUNCTION,
    PENDING,
    QUEUES,
    REQUEUES_AFTER_WORKER_DEATH,
    job_id,
    partition_key,
    readable_part,
    readable_part_of,
)
from common.protocol.serializer import PlainPickle
from common.records import GenerationJob, PromptRef
from common.settings import Settings
from common.store import OutputStore
from producer.partitions import Partition
from producer.prompts import Prompt, Reject, Rejected, prompt_version, read_prompts
from producer.rejects import write_rejects

if TYPE_CHECKING:
    # Only a type here: importing transformers takes a second or two, and retry-failed reads this module.
    from producer.tokenizer import ChatTokenizer


@dataclass
class PartitionSummary:
    partition: str
    total: int = 0
    done: int = 0
    pending: int = 0
    failed: int = 0
    enqueued: int = 0
    rejected: int = 0
    # Prompts edited since their output was made: generated again.
    changed: int = 0
    # Failed jobs of an earlier version of an edited prompt: deleted, so that retry-failed cannot run them.
    superseded: int = 0
    # Prompt tokens of the prompts tokenized by this run: their mean sizes the server's concurrency (plan).
    prompt_tokens: int = 0
    tokenized: int = 0
    rejects: list[Reject] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The counts, and each reject with its file, line, reason and sample id."""
        return asdict(self)


@dataclass
class _Candidate:
    prompt: Prompt
    job_id: str
    version: str


class Enqueuer:
    def __init__(
        self,
        connection: Redis,
        settings: Settings,
        tokenizer: ChatTokenizer,
        store: OutputStore,
        batch_size: int = 500,
    ) -> None:
        self.connection = connection
        self.settings = settings
        self.tokenizer = tokenizer
        self.store = store
        self.batch_size = batch_size
        self.script = connection.register_script(scripts.ENQUEUE)
        # Every queue's, not only the partition's own: the partition may have changed queues since its job failed.
        self.failed_registries = [
            FailedJobRegistry(name, connection=connection, serializer=PlainPickle).key for name in QUEUES
        ]
        self._failed: dict[str, set[str]] | None = None

    def enqueue(self, partition: Partition) -> PartitionSummary:
        summary = PartitionSummary(partition.name)
        queue = Queue(partition.queue, connection=self.connection, serializer=PlainPickle)
        sampling_params = partition.sampling_params(self.settings)
        # `status` reads done counts that workers keep; they are reset here to the store's count. A commit made
        # while the store is listed may be counted twice: `status --recount` counts again when workers are idle.
        counter = partition_key(partition.name)
        self.connection.hset(counter, "done", 0)
        done = self.store.done(partition.name)
        self.connection.hincrby(counter, "done", len(done))
        # The samples with an output of some version: one whose prompt changed since is generated again.
        generated = {readable_part_of(identifier) for identifier in done}
        # Failed jobs by sample: one of a sample of the partition with another ID is of an earlier version.
        failed = self._failed_jobs()
        earlier: dict[str, str] = {}
        batch: list[_Candidate] = []
        lines = tqdm(read_prompts(partition.path), desc=partition.name, unit=" prompts", disable=None, leave=False)
        for item in lines:
            summary.total += 1
            if isinstance(item, Reject):
                summary.rejects.append(item)
                continue
            version = prompt_version(item, sampling_params)
            candidate = _Candidate(item, job_id(partition.name, item.sample_id, version), version)
            readable = readable_part(partition.name, item.sample_id)
            for other in failed.get(readable, ()):
                if other != candidate.job_id:
                    earlier[other] = f"{DESCRIPTION_PREFIX}{partition.name}/{item.sample_id}"
            # An output made before versions (no version in its ID) is taken as the prompt's: nothing done is lost.
            if candidate.job_id in done or job_id(partition.name, item.sample_id) in done:
                summary.done += 1
                continue
            summary.changed += readable in generated
            batch.append(candidate)
            if len(batch) >= self.batch_size:
                self._enqueue_batch(batch, partition, queue, sampling_params, summary)
                batch = []
        self._enqueue_batch(batch, partition, queue, sampling_params, summary)
        summary.superseded = self._delete_earlier_versions(earlier)
        summary.rejected = len(summary.rejects)
        self._record_totals(partition, summary)
        return summary

    def _enqueue_batch(
        self,
        batch: list[_Candidate],
        partition: Partition,
        queue: Queue,
        sampling_params: dict[str, Any],
        summary: PartitionSummary,
    ) -> None:
        # Look before tokenizing, so that a re-run over queued or failed prompts costs a round trip or two.
        statuses = self._statuses([candidate.job_id for candidate in batch])
        tokenized: list[tuple[_Candidate, list[int]]] = []
        for candidate, status in zip(batch, statuses, strict=True):
            if status in PENDING:
                summary.pending += 1
            elif status == JobStatus.FAILED:
                summary.failed += 1
            else:
                input_ids = self._tokenize(candidate.prompt, partition, sampling_params, summary)
                if input_ids is not None:
                    tokenized.append((candidate, input_ids))
                    summary.prompt_tokens += len(input_ids)
                    summary.tokenized += 1
        if not tokenized:
            return
        # The prompts' ids go to the store, once per batch; each job carries only where its prompt is.
        refs = self.store.write_prompts(partition.name, [input_ids for _, input_ids in tokenized])
        jobs = [
            self._build_job(candidate, ref, partition, queue, sampling_params)
            for (candidate, _), ref in zip(tokenized, refs, strict=True)
        ]
        with self.connection.pipeline(transaction=False) as pipeline:
            for job in jobs:
                keys = [job.key, queue.key, Queue.redis_queues_keys]
                keys += [queue.finished_job_registry.key, queue.canceled_job_registry.key, *self.failed_registries]
                self.script(keys=keys, args=[job.id, *_flatten(job.to_dict())], client=pipeline)
            results = pipeline.execute()
        for result in results:
            outcome = result.decode()
            if outcome == "enqueued":
                summary.enqueued += 1
            elif outcome == JobStatus.FAILED:
                summary.failed += 1
            else:
                summary.pending += 1

    def _failed_jobs(self) -> dict[str, set[str]]:
        """Every failed job's ID, by the readable part of its ID. Read once per run: few jobs fail."""
        if self._failed is None:
            self._failed = defaultdict(set)
            for key in self.failed_registries:
                for identifier in (item.decode() for item in self.connection.zrange(key, 0, -1)):
                    self._failed[readable_part_of(identifier)].add(identifier)
        return self._failed

    def _delete_earlier_versions(self, earlier: dict[str, str]) -> int:
        """Delete the failed jobs of earlier versions of edited prompts; how many. `earlier` maps each job ID to
        the description of its sample's jobs, which tells it from a sample whose ID has the same readable part."""
        deleted = 0
        for identifier, description in earlier.items():
            try:
                job = Job.fetch(identifier, connection=self.connection, serializer=PlainPickle)
            except NoSuchJobError:
                continue
            if job.description == description and job.get_status() == JobStatus.FAILED:
                job.delete()
                deleted += 1
        return deleted

    def _statuses(self, job_ids: list[str]) -> list[str | None]:
        """Each job's status; None where there is no job, or a failed one lost from the failed registries."""
        with self.connection.pipeline(transaction=False) as pipeline:
            for identifier in job_ids:
                pipeline.hget(Job.key_for(identifier), "status")
            statuses = [status.decode() if status else None for status in pipeline.execute()]
        failed = [identifier for identifier, status in zip(job_ids, statuses, strict=True) if status == "failed"]
        if not failed:
            return statuses
        lost = set(failed) - self._listed_as_failed(failed)
        return [None if identifier in lost else status for identifier, status in zip(job_ids, statuses, strict=True)]

    def _listed_as_failed(self, job_ids: list[str]) -> set[str]:
        """Those of `job_ids` that a failed registry lists, for retry-failed to requeue."""
        with self.connection.pipeline(transaction=False) as pipeline:
            for identifier in job_ids:
                for key in self.failed_registries:
                    pipeline.zscore(key, identifier)
            scores = pipeline.execute()
        per_job = len(self.failed_registries)
        return {
            identifier
            for index, identifier in enumerate(job_ids)
            if any(score is not None for score in scores[index * per_job : (index + 1) * per_job])
        }

    def _tokenize(
        self, prompt: Prompt, partition: Partition, sampling_params: dict[str, Any], summary: PartitionSummary
    ) -> list[int] | None:
        """The prompt's ids, or None with the reason added to the rejects."""
        try:
            input_ids = self.tokenizer.encode(prompt)
            # SGLang cuts max_new_tokens to context length - 1 - prompt - 1 (scheduler.init_req_max_new_tokens):
            # a longer request would end two tokens early, as if cut at max_new_tokens.
            limit = self.settings.context_length - 2
            if len(input_ids) + sampling_params["max_new_tokens"] > limit:
                raise Rejected(
                    f"{len(input_ids)} prompt tokens + max_new_tokens {sampling_params['max_new_tokens']}"
                    f" exceed the context length {self.settings.context_length} less the 2 tokens SGLang keeps"
                )
        except Rejected as error:
            summary.rejects.append(Reject(str(partition.path), prompt.line, str(error), prompt.sample_id))
            return None
        return input_ids

    def _build_job(
        self, candidate: _Candidate, ref: PromptRef, partition: Partition, queue: Queue, sampling_params: dict[str, Any]
    ) -> Job:
        prompt = candidate.prompt
        arguments = GenerationJob(
            partition=partition.name,
            sample_id=prompt.sample_id,
            prompt=ref,
            sampling_params=sampling_params,
            version=candidate.version,
        )
        job = Job.create(
            JOB_FUNCTION,
            kwargs=arguments.model_dump(exclude_none=True),
            connection=self.connection,
            id=candidate.job_id,
            origin=queue.name,
            description=f"{DESCRIPTION_PREFIX}{partition.name}/{prompt.sample_id}",
            # A healthy generation can run for many minutes: no job timeout.
            timeout=-1,
            result_ttl=self.settings.result_ttl,
            serializer=PlainPickle,
            status=JobStatus.QUEUED,
            retry=Retry(max=REQUEUES_AFTER_WORKER_DEATH, enqueue_at_front=True),
        )
        job.enqueued_at = datetime.now(UTC)
        return job

    def _record_totals(self, partition: Partition, summary: PartitionSummary) -> None:
        """Totals for status tooling, and the rejects report beside the outputs."""
        recorded = {
            "total": summary.total,
            "rejected": summary.rejected,
            "queue": partition.queue,
            "updated_at": datetime.now(UTC).isoformat(),
        }
        if summary.tokenized:
            recorded |= {"mean_prompt_tokens": summary.prompt_tokens // summary.tokenized}
        self.connection.hset(partition_key(partition.name), mapping=recorded)
        write_rejects(self.store, partition.name, summary.rejects)


def _flatten(mapping: dict[str, Any]) -> list[Any]:
    """The job hash's fields as HSET takes them, less the empty ones (RQ reads a missing field as empty): each
    field costs Redis memory in every pending job."""
    return [item for pair in mapping.items() if pair[1] != "" for item in pair]
