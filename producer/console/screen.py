"""The status snapshot as one screen of text."""

from __future__ import annotations

import time

from producer.console.causes import fix_for
from producer.console.roster import WorkerView
from producer.console.status import PartitionProgress, Status
from producer.wording import plural

COLUMNS = (
    "partition",
    "total",
    "rejected",
    "done",
    "queued",
    "in flight",
    "failed",
    "not queued",
    "%",
    "samples/s",
    "ETA",
)


def render(status: Status) -> str:
    moment = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.at))
    lines = [f"fleet status at {moment}, Redis {status.redis}", ""]
    lines += _partitions(status)
    lines += ["", *_throughput(status), "", *_workers(status.workers), "", *_servers(status)]
    if status.failures:
        lines += ["", f"failures ({plural(sum(len(group) for _, group in status.failures), 'job')}, by cause)"]
        for cause, group in status.failures:
            partitions = ", ".join(sorted({failure.partition for failure in group}))
            workers = ", ".join(sorted({failure.worker for failure in group if failure.worker}))
            lines.append(f"  {len(group):>6}  {cause}  [{partitions}; e.g. {group[0].job_id}; by {workers or '?'}]")
            if fix := fix_for(cause):
                lines.append(f"          fix: {fix}")
    lines.append("")
    lines += [f"note: {note}" for note in status.notes]
    if status.problems:
        lines.append(f"PROBLEMS ({len(status.problems)})")
        lines += [f"  ! {problem}" for problem in status.problems]
    else:
        lines.append("no problems found")
    return "\n".join(lines)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, second = divmod(round(seconds), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}:{minute:02}:{second:02}"


def _partitions(status: Status) -> list[str]:
    rows = [COLUMNS]
    for partition in status.partitions:
        rows.append(_partition_row(partition))
    if len(status.partitions) > 1:
        whole = PartitionProgress(
            "all",
            total=_sum_known([partition.total for partition in status.partitions]),
            rejected=_sum_known([partition.rejected for partition in status.partitions]),
            done=sum(partition.done for partition in status.partitions),
            queued=sum(partition.queued for partition in status.partitions),
            in_flight=sum(partition.in_flight for partition in status.partitions),
            failed=sum(partition.failed for partition in status.partitions),
            samples_per_s=status.throughput.samples_per_s,
        )
        rows.append(_partition_row(whole))
    if len(rows) == 1:
        return ["no partitions enqueued yet (`python -m producer enqueue`)"]
    width = max(len(row[0]) for row in rows)
    return [f"{row[0]:<{width}}" + "".join(f"{cell:>11}" for cell in row[1:]) for row in rows]


def _partition_row(partition: PartitionProgress) -> tuple[str, ...]:
    percent = "-" if partition.percent is None else f"{partition.percent:.1f}"
    return (
        partition.name,
        _known(partition.total),
        _known(partition.rejected),
        str(partition.done),
        str(partition.queued),
        str(partition.in_flight),
        str(partition.failed),
        _known(partition.unqueued),
        percent,
        f"{partition.samples_per_s:.2f}",
        duration(partition.eta_s),
    )


def _throughput(status: Status) -> list[str]:
    throughput = status.throughput
    lines = [
        f"throughput  last {throughput.window_s:.0f}s: {throughput.samples_per_s:.2f} samples/s,"
        f" {throughput.tokens_per_s:,.0f} generated tokens/s"
    ]
    if throughput.started_at is not None:
        lines.append(
            f"            since the first commit {duration(status.at - throughput.started_at)} ago:"
            f" {throughput.samples:,} samples, {throughput.tokens:,} tokens,"
            f" {throughput.average_samples_per_s:.2f} samples/s, {throughput.average_tokens_per_s:,.0f} tokens/s"
        )
    lines.append(f"ETA         {duration(status.eta_s)} for the queued and in-flight jobs at the last minute's pace")
    return lines


def _workers(workers: list[WorkerView]) -> list[str]:
    live = sum(worker.state in ("ok", "starting") for worker in workers)
    if not workers:
        return ["workers: none"]
    lines = [f"workers ({live} live of {len(workers)})"]
    for worker in workers:
        jobs = "  ".join(
            f"{queue} {worker.in_flight.get(queue, 0)}/{worker.slots.get(queue, '?')}" for queue in worker.queues
        )
        age = "never" if worker.heartbeat_age_s is None else f"{worker.heartbeat_age_s:.1f}s ago"
        lines.append(
            f"  {worker.name}  {worker.host}  pid {worker.pid}  {jobs}  heartbeat {age}  {worker.state.upper()}"
        )
        lines += [f"      ! {flag}" for flag in worker.flags]
    return lines


def _servers(status: Status) -> list[str]:
    lines = ["servers"]
    for server in status.servers:
        parts = [f"  {server.url}  {server.health.upper()}"]
        if server.health != "healthy":
            parts.append(server.detail)
        if server.supervisor:
            parts.append("supervisor: " + ", ".join(f"{key} {value}" for key, value in server.supervisor.items()))
        figures = server.metrics
        if figures:
            parts.append(
                f"running {figures.get('running_req', 0):.0f}, queued {figures.get('queue_req', 0):.0f},"
                f" token usage {100 * figures.get('token_usage', 0):.0f}%,"
                f" {figures.get('gen_throughput', 0):,.0f} tokens/s"
                f" ({server.metrics_from}, {server.metrics_age_s:.0f}s old)"
            )
        elif server.health == "healthy":
            parts.append("no load figures (no supervisor, no --enable-metrics)")
        parts.append(f"{server.workers_in_flight} in flight from workers")
        lines.append("  ".join(parts))
        if server.down_for_workers:
            lines.append(f"      ! down for workers {', '.join(server.down_for_workers)}")
    return lines


def _known(value: int | None) -> str:
    return "?" if value is None else str(value)


def _sum_known(values: list[int | None]) -> int | None:
    return None if any(value is None for value in values) else sum(value for value in values if value is not None)
