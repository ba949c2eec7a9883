"""The one way every component connects to the fleet's Redis."""

from __future__ import annotations

import redis

from common.settings import Settings


class RedisUnavailable(Exception):
    """Redis cannot be reached; the message names where (never the password)."""


def connect(settings: Settings) -> redis.Redis:
    connection = redis.Redis.from_url(settings.redis_url, health_check_interval=30)
    try:
        connection.ping()
    except redis.RedisError as error:
        raise RedisUnavailable(f"cannot reach Redis at {settings.redis_url_redacted}: {error}") from error
    return connection
