"""A real S3 server (SeaweedFS) for the tests: bucket names, client environments, clients."""

from __future__ import annotations

import os
import uuid
from typing import Any

from weightcast.local.s3_server import S3Server


def unique_bucket() -> str:
    """A bucket name no other test uses (lowercase, 3-63 characters: a valid S3 name)."""
    return f"t-{uuid.uuid4().hex[:12]}"


def s3_process_env(server: S3Server, base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default: ``os.environ``) with what an S3 client needs to reach
    ``server``: dummy keys, a region, ``AWS_ENDPOINT_URL``. For subprocesses; in-process
    clients take the ``s3_env`` fixture (set for the test only) or :func:`s3_client`."""
    return {**(os.environ if base is None else base), **server.client_env()}


def s3_client(server: S3Server, retries: int = 1) -> Any:
    """A boto3 S3 client of ``server``, configured explicitly (nothing read from the
    environment); ``retries`` attempts in all, so that a fault shows at once."""
    import boto3  # here: conftest imports this module, and not every test venv has boto3
    from botocore.config import Config

    env = server.client_env()
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
        config=Config(retries={"max_attempts": retries, "mode": "standard"}),
    )


def store_settings(server: S3Server, bucket: str, retry_seconds: float = 60) -> dict[str, object]:
    """The settings that put a deployment's versions in ``s3://bucket/run`` on ``server``
    (``retry_seconds``: how long a call rides out the server's absence)."""
    return {
        "weights_url": f"s3://{bucket}/run",
        "s3_endpoint_url": server.endpoint_url,
        "s3_addressing_style": "path",
        "store_retry_seconds": retry_seconds,
    }
