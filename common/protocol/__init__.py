"""The fleet's job-state protocol in Redis, in one place: every key (`keys`), every Lua script that changes a
job's state (`scripts`), RQ's own records of a job's outcome as the fleet writes them (`outcomes`), and how
job data is serialized (`serializer`: plain values only).

The fleet shares RQ's jobs, queues and registries, so that `rq info` and rq-dashboard show it as it is, and
relies on their layout in RQ 2.x:
- a job is the hash `rq:job:<id>`, whose `status` is queued, started, finished, failed, canceled, ...;
- a queue is the list `rq:queue:<name>`, and the set `rq:queues` lists the queues' keys;
- a queue's StartedJobRegistry is a sorted set of `<job id>:<execution id>` members, which RQ's cleanup
  requeues once their score is past its own host's clock: the fleet scores its members +inf and keeps the
  real lease (on Redis's clock) in a set of its own, `keys.lease_key`, the fleet-wide semaphore;
- the Finished, Failed and Canceled registries are sorted sets of job IDs.
Each state change is one Lua script, so that no job is ever half-claimed, half-requeued or pushed twice.
"""
