"""The fleet's workers as RQ and their own reports see them, with the ones that need a look flagged.

A live FleetWorker refreshes its report (`common.protocol.keys.worker_state_key`) every heartbeat, and the
report expires `lease_ttl` seconds after the last one. So:
- stale: a report whose heartbeat is late (the process is stopped, hung, or its host's clock is off);
- dead: registered with RQ but without a report (crashed between the two expiries, or a plain RQ worker,
  which cannot run generation jobs);
- duplicate: more than one FleetWorker on one host (two started where one was meant; several per host
  are intended only with FLEET_WORKER_*_CONCURRENCY).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from rq import Worker

from common.protocol.keys import QUEUES, worker_state_key
from common.protocol.serializer import PlainPickle
from common.records import WorkerReport
from common.settings import Settings

# A heartbeat this many intervals late (plus a second for busy hosts) marks a worker stale.
STALE_AFTER_INTERVALS = 3


@dataclass
class WorkerView:
    name: str
    host: str | None
    pid: int | None
    queues: list[str]
    in_flight: dict[str, int] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    heartbeat_age_s: float | None = None
    state: str = "ok"  # ok, starting, stale or dead
    flags: list[str] = field(default_factory=list)
    servers: list[dict[str, Any]] = field(default_factory=list, repr=False)


def list_workers(connection: Redis, settings: Settings, now: float) -> list[WorkerView]:
    reports = _reports(connection)
    registered = {worker.name: worker for worker in Worker.all(connection=connection, serializer=PlainPickle)}
    stale_after = STALE_AFTER_INTERVALS * settings.heartbeat_interval + 1
    views = []
    for name, report in reports.items():
        view = WorkerView(
            name=name,
            host=report.host,
            pid=report.pid,
            queues=report.queues,
            in_flight=report.in_flight,
            slots=report.slots,
            heartbeat_age_s=max(0.0, now - report.heartbeat_at),
            servers=[server.model_dump() for server in report.servers],
        )
        if view.heartbeat_age_s > stale_after:
            view.state = "stale"
            view.flags.append(f"last heartbeat {view.heartbeat_age_s:.0f}s ago: stopped, hung or clock off")
        if name not in registered:
            view.flags.append("not registered with RQ (Redis lost it; it registers again on its next heartbeat)")
        for queue, count in view.in_flight.items():
            if count > view.slots.get(queue, count):
                view.flags.append(f"{count} {queue} jobs in flight, above its {view.slots[queue]} slots")
        views.append(view)
    for name, worker in registered.items():
        if name in reports:
            continue
        age = now - worker.last_heartbeat.timestamp() if worker.last_heartbeat else None
        view = WorkerView(name, worker.hostname, worker.pid, worker.queue_names(), heartbeat_age_s=age)
        if worker.birth_date and now - worker.birth_date.timestamp() <= stale_after:
            view.state = "starting"  # its first report comes with its first heartbeat
        else:
            view.state = "dead"
            view.flags.append("registered with RQ but sends no fleet heartbeat: crashed, or not a FleetWorker")
        views.append(view)
    _flag_duplicates(views)
    return sorted(views, key=lambda view: (view.host or "", view.name))


def fleet_load(views: list[WorkerView], settings: Settings) -> dict[str, dict[str, int]]:
    """Per queue, the jobs in flight in the workers that report, and the fleet-wide cap on them."""
    queues = sorted({queue for view in views for queue in view.queues} | set(QUEUES))
    return {
        queue: {
            "in_flight": sum(view.in_flight.get(queue, 0) for view in views if view.state != "dead"),
            "cap": settings.concurrency(queue),
        }
        for queue in queues
    }


def _reports(connection: Redis) -> dict[str, WorkerReport]:
    keys = sorted(connection.scan_iter(match=worker_state_key("*"), count=1000))
    reports = {}
    for raw in connection.mget(keys) if keys else []:
        if raw:  # expired between SCAN and MGET
            report = WorkerReport.model_validate_json(raw)
            reports[report.name] = report
    return reports


def _flag_duplicates(views: list[WorkerView]) -> None:
    per_host = Counter(view.host for view in views if view.state in ("ok", "stale"))
    for view in views:
        if view.state in ("ok", "stale") and per_host[view.host] > 1:
            view.flags.append(f"duplicate: {per_host[view.host]} FleetWorkers on host {view.host}")
