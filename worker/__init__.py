"""Turns generation jobs into committed outputs: `rq worker -w worker.FleetWorker short long`."""

from worker.fleet import FleetWorker

__all__ = ["FleetWorker"]
