"""Fixtures of the integration tier (a real redis-server, real version directories)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from weightcast.contract.keys import Keys
from weightcast.local.redis_server import RedisServer

from helpers.versions import Deployment


@pytest.fixture
def deployment(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> Deployment:
    """A weights root with one version, v1, published by the real publisher at tp 2 (a test
    module may define its own ``deployment``)."""
    deployment = Deployment(client, keys, tmp_path, redis_server.url, tp=2)
    deployment.publish()
    return deployment
