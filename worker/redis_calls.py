"""Blocking Redis calls made from the worker's event loop, patient while Redis is unreachable."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import redis

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors that pass: Redis unreachable, restarting or loading its data, full under `noeviction`, a replica
# that was just demoted, or busy running a long script (a BUSY reply). Anything else is a bug and is raised.
_PASSING = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.TryAgainError,
)


async def call_redis(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `function` in a thread, retrying with backoff while Redis is down, restarting or full.

    A generation that finished while Redis was away must still be recorded once Redis is back,
    never turned into a failure.
    """
    delay = 0.1
    while True:
        try:
            return await asyncio.to_thread(function, *args, **kwargs)
        except redis.RedisError as error:
            if not isinstance(error, _PASSING) and not _busy(error):
                raise
            log.warning("Redis unavailable (%s); retrying in %.1fs", error, delay)
            await asyncio.sleep(delay)
            # A second at most: leases must be renewed soon after Redis answers again.
            delay = min(delay * 2, 1.0)


def _busy(error: redis.RedisError) -> bool:
    """Redis runs a script longer than its busy-reply threshold: the command was not run, and can be sent again."""
    return str(error).startswith("BUSY")
