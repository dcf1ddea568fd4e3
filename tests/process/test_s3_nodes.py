"""Nodes on other hosts: node processes that cannot see the publisher's directory follow its
versions through a real S3 server (SeaweedFS), by delta, bitwise; sixteen at once; a missing
bucket stops a node and the publisher in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file

from weightcast.client.reader import VersionReader
from weightcast.contract.keys import Keys
from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server

from helpers.files import REPO
from helpers.processes import (
    OutputLines,
    run_weightcast,
    start_weightcast,
    stop,
    with_test_modules,
)
from helpers.s3 import s3_process_env, store_settings
from helpers.versions import Deployment

pytestmark = pytest.mark.slow


def node_env(
    cli_env: dict[str, str], server: S3Server, bucket: str, tmp_path: Path
) -> dict[str, str]:
    """A node's environment: the bucket, and a weights directory of its own that holds
    nothing (it reads no directory)."""
    env = s3_process_env(server, cli_env)
    env.update(
        WEIGHTCAST_WEIGHTS_URL=f"s3://{bucket}/run",
        WEIGHTCAST_S3_ENDPOINT_URL=server.endpoint_url,
        WEIGHTCAST_S3_ADDRESSING_STYLE="path",
        WEIGHTCAST_WEIGHTS_DIR=str(tmp_path / "node-weights"),
    )
    return env


@pytest.fixture
def deployment(
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    redis_server: RedisServer,
    s3_server: S3Server,
    s3_bucket: str,
    s3_env: dict[str, str],
) -> Deployment:
    settings = store_settings(s3_server, s3_bucket)
    return Deployment(client, keys, tmp_path, redis_server.url, store=settings)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_a_node_that_cannot_see_the_publisher_directory_follows_it_through_the_bucket(
    deployment: Deployment,
    cli_env: dict[str, str],
    s3_server: S3Server,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    """The node runs in a mount namespace of its own where a tmpfs hides the publisher's
    checkpoint and weights directories: what it loads can only come from the bucket."""
    deployment.publish()
    hidden = [deployment.root / "weights", deployment.root / "checkpoints"]
    out = tmp_path / "held.safetensors"
    script = " && ".join(
        [*(f"mount -t tmpfs none {p}" for p in hidden), f'test -z "$(ls -A {hidden[0]})"']
    )
    node_args = [sys.executable, "-m", "store_node", "--until", "4", "--out", str(out)]
    command = ["unshare", "--mount", "sh", "-c", f'{script} && exec "$@"', "node", *node_args]
    env = with_test_modules(node_env(cli_env, s3_server, s3_bucket, tmp_path))
    node = subprocess.Popen(
        command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = OutputLines(node)
    try:
        for version in (1, 2, 3):  # the node loads each version before the next is published
            output.wait_for(rf'"version": {version},', timeout=120)
            deployment.publish()
        output.wait_for(r'"version": 4,', timeout=120)
        assert node.wait(timeout=60) == 0, output.text()
    finally:
        stop(node)
    loads = [json.loads(line) for line in output.text().splitlines() if line.startswith("{")]
    assert [load["version"] for load in loads] == [1, 2, 3, 4]
    assert [load["via"] for load in loads] == ["full", "delta", "delta", "delta"], loads
    newest = deployment.reader().info(4)
    expected = VersionReader(deployment.root / "weights").load(newest)
    held = load_file(str(out))
    assert held.keys() == expected.keys()  # the node held the newest version, bitwise
    assert all(torch.equal(held[k], expected[k]) for k in expected)


def test_sixteen_nodes_follow_one_bucket_and_end_verified_on_the_newest_without_leases(
    deployment: Deployment,
    cli_env: dict[str, str],
    s3_server: S3Server,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    deployment.publish()
    env = node_env(cli_env, s3_server, s3_bucket, tmp_path)
    nodes = [
        start_weightcast(
            env,
            tmp_path / f"node-{i}.log",
            "follow",
            "--node-id",
            f"node-{i}",
            "--until-version",
            "3",
            "--poll-seconds",
            "0.5",
        )
        for i in range(16)
    ]
    try:
        for _ in range(2):
            time.sleep(2)
            deployment.publish()
        for node in nodes:
            node.wait(timeout=240)
    finally:
        for node in nodes:
            stop(node)
    logs = {i: (tmp_path / f"node-{i}.log").read_text() for i in range(16)}
    assert [n.returncode for n in nodes] == [0] * 16, logs
    reports = deployment.client.hgetall(deployment.keys.nodes)
    assert len(reports) == 16
    assert all(json.loads(r)["version"] == 3 for r in reports.values()), reports
    assert not any(deployment.client.exists(deployment.keys.leases(v)) for v in (1, 2, 3))


def test_a_missing_bucket_stops_a_node_and_the_publisher_in_one_line(
    cli_env: dict[str, str], s3_server: S3Server, tmp_path: Path
) -> None:
    env = node_env(cli_env, s3_server, "no-such-bucket", tmp_path)
    for command in (("follow",), ("publisher", "--once")):
        done = run_weightcast(env, *command, timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert "no such bucket" in lines[-1], done.stderr
        assert "Traceback" not in done.stderr
