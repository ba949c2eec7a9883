"""Blocking Redis calls made from the worker's event loop, patient while Redis is unreachable."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import redis

log = logging.getLogger(__name__)
T = TypeVar("T")


async def call_redis(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `function` in a thread, retrying with backoff while Redis is down or restarting.

    A generation that finished while Redis was away must still be recorded once Redis is back,
    never turned into a failure.
    """
    delay = 0.1
    while True:
        try:
            return await asyncio.to_thread(function, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as error:
            log.warning("Redis unavailable (%s); retrying in %.1fs", error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
