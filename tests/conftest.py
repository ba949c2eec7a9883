from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests.harness import Fleet, RedisServer, SeaweedFS, Simulator

# A test that uses one of these starts real processes: it belongs to the end-to-end tier.
PROCESS_FIXTURES = {"redis_server", "redis_client", "fleet", "start_simulator", "seaweedfs"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that start processes `e2e`: `scripts/test.sh -m "not e2e"` runs the fast tier alone."""
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> redis.Redis:
    """A client of the tests' own redis-server, emptied before each test."""
    if not redis_server.alive():
        redis_server.start()
    client = redis_server.client()
    client.flushall()
    return client


@pytest.fixture
def start_simulator(tmp_path: Path) -> Iterator[Callable[..., Simulator]]:
    """Start simulators with the given flags; all are killed at teardown."""
    started: list[Simulator] = []

    def start(*flags: str, port: int | None = None) -> Simulator:
        simulator = Simulator(tmp_path / f"simulator-{len(started)}.log", *flags, port=port).start()
        started.append(simulator)
        return simulator

    yield start
    for simulator in started:
        simulator.kill()


@pytest.fixture
def fleet(tmp_path: Path, redis_client: redis.Redis, redis_server: RedisServer) -> Iterator[Fleet]:
    """Settings and processes of a fleet on the tests' redis-server; point it at a simulator with `sglang_url`."""
    fleet = Fleet(tmp_path, redis_server.url)
    yield fleet
    fleet.stop()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """An S3 server for the tests, with its credentials in this process's environment (as obstore reads them)."""
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs")).start()
    saved = {key: os.environ.get(key) for key in SeaweedFS.CREDENTIALS}
    os.environ.update(SeaweedFS.CREDENTIALS)
    yield server
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.kill()
