"""Shared fixtures: a real redis-server on a free loopback port, and the weightcast CLI."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from shared.keys import Keys
from shared.redis_server import RedisServer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One private redis-server for the session; tests isolate themselves by namespace."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_server.url)
    yield connection
    connection.close()


@pytest.fixture
def cli_env(redis_server: RedisServer, keys: Keys, tmp_path: Path) -> dict[str, str]:
    """Environment for ``weightcast`` subprocesses: this test's Redis, namespace, dirs."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "WEIGHTCAST_REDIS_URL": redis_server.url,
        "WEIGHTCAST_NAMESPACE": keys.namespace,
        "WEIGHTCAST_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "WEIGHTCAST_WEIGHTS_DIR": str(tmp_path / "weights"),
    }
