"""The one way every component connects to the fleet's Redis."""

from __future__ import annotations

import redis

from common.settings import Settings


class RedisUnavailable(Exception):
    """Redis cannot be reached; the message names where (never the password)."""


def connect(settings: Settings) -> redis.Redis:
    # A Redis that stops answering (paused, a network partition) must fail a call, to be retried, not hang it.
    connection = redis.Redis.from_url(
        settings.redis_url, health_check_interval=30, socket_timeout=settings.redis_timeout, socket_connect_timeout=10
    )
    try:
        connection.ping()
    except redis.RedisError as error:
        raise RedisUnavailable(f"cannot reach Redis at {settings.redis_url_redacted}: {error}") from error
    return connection


def connection_url(connection: redis.Redis) -> str:
    """Where a client connects, as a URL without user or password: for banners, and to compare two clients."""
    options = connection.connection_pool.connection_kwargs
    if "path" in options:
        return f"unix://{options['path']}?db={options.get('db', 0)}"
    host = options.get("host", "localhost")
    host = "127.0.0.1" if host == "localhost" else host
    scheme = "rediss" if issubclass(connection.connection_pool.connection_class, redis.SSLConnection) else "redis"
    return f"{scheme}://{host}:{options.get('port', 6379)}/{options.get('db', 0)}"
