"""Fixtures of the real-size tier: the 0.6B versions, published once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server

from helpers.realsize import RealSizeVersions, published


@pytest.fixture(scope="session")
def realsize(
    redis_server: RedisServer, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealSizeVersions]:
    """The tier's versions in a bucket and in the publisher's weights directory."""
    with published(redis_server.url, s3_server, tmp_path_factory.mktemp("realsize")) as versions:
        yield versions
