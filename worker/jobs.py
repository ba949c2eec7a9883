"""The job function that producers name. Only FleetWorker runs these jobs, with its own code."""

from __future__ import annotations


def generate(**_: object) -> None:
    """Fail loudly when a plain RQ worker picks up a generation job; the job stays in the failed registry."""
    raise RuntimeError(
        "generation jobs run only in worker.FleetWorker: start workers with "
        "`rq worker -w worker.FleetWorker short long` or `python -m worker short long`, "
        "then `python -m producer retry-failed`"
    )
