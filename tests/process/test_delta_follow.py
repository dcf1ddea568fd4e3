"""``weightcast follow`` moves from version to version by delta, through the real publisher
and follow processes, and says so in its node record and in ``weightcast status``."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import redis
import torch

from weightcast.contract.keys import Keys
from weightcast.contract.nodes import NodeReport
from weightcast.local.redis_server import RedisServer

from helpers.models import drift, hf_state, shape_of
from helpers.processes import run_env, run_weightcast, start_weightcast, stop, wait_for
from helpers.versions import publish_snapshot

SHAPE = dataclasses.replace(shape_of(4, 2, 32, hidden=128, inter=512, tied=False), vocab_size=512)


def test_follow_loads_each_next_version_by_delta_and_status_shows_it(
    keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    env = run_env(redis_server.url, keys.namespace, tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    publisher = start_weightcast(
        env, logs / "publisher.log", "publisher", "--rescan-seconds", "0.2"
    )
    follow = start_weightcast(env, logs / "follow.log", "follow", "--poll-seconds", "0.2")
    state = hf_state(SHAPE, torch.bfloat16)

    def node_on(version: int) -> NodeReport | None:
        reports = [NodeReport.parse(v) for v in client.hvals(keys.nodes)]
        return next((r for r in reports if r.version == version), None)

    try:
        for step in (1, 2, 3):
            drift(state, step)
            publish_snapshot(tmp_path / "checkpoints", step, SHAPE, state)
            wait_for(lambda s=step: int(client.get(keys.latest) or 0) >= s, 120, f"version {step}")
            latest = int(client.get(keys.latest))
            wait_for(lambda v=latest: node_on(v), 120, f"follow to load version {latest}")
            report = node_on(latest)
            assert report is not None
            size = int(client.hget(keys.version(latest), "bytes"))
            if step == 1:
                assert report.via == "full" and report.read_bytes > size / 2
            else:
                assert report.via == "delta", (logs / "follow.log").read_text()[-2000:]
                assert 0 < report.read_bytes < size / 10
        status = run_weightcast(env, "status")
        assert status.returncode == 0, status.stderr
        assert f"v{latest} (reported" in status.stdout and "by delta:" in status.stdout
        shown = json.loads(run_weightcast(env, "status", "--json").stdout)
        (node,) = shown["nodes"].values()
        assert node["via"] == "delta" and node["read_bytes"] == report.read_bytes
    finally:
        for process in (publisher, follow):
            stop(process)
        client.close()


def test_a_follower_that_fell_behind_catches_up_by_a_chain_of_deltas(
    keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> None:
    """A follow process frozen (SIGSTOP) while three versions are published wakes (SIGCONT)
    holding v1 and loads the newest by the chain of their deltas (v2's delta-only by then),
    and says so; it holds no lease afterwards."""
    client = redis.Redis.from_url(redis_server.url)
    env = run_env(redis_server.url, keys.namespace, tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    publisher = start_weightcast(
        env, logs / "publisher.log", "publisher", "--rescan-seconds", "0.2"
    )
    follow = start_weightcast(env, logs / "follow.log", "follow", "--poll-seconds", "0.2")
    state = hf_state(SHAPE, torch.bfloat16)

    def node_on(version: int) -> NodeReport | None:
        reports = [NodeReport.parse(v) for v in client.hvals(keys.nodes)]
        return next((r for r in reports if r.version == version), None)

    try:
        for step in (1, 2, 3, 4):
            drift(state, step)
            publish_snapshot(tmp_path / "checkpoints", step, SHAPE, state)
            wait_for(lambda s=step: int(client.get(keys.latest) or 0) >= s, 120, f"version {step}")
            if step == 1:
                wait_for(lambda: node_on(1), 120, "follow to load version 1")
                follow.send_signal(signal.SIGSTOP)
        latest = int(client.get(keys.latest))
        wait_for(lambda: client.zcard(keys.deltas) == 1, 60, "v2 to be delta-only")
        follow.send_signal(signal.SIGCONT)
        report = wait_for(lambda: node_on(latest), 120, f"follow to load version {latest}")
        size = int(client.hget(keys.version(latest), "bytes"))
        assert report.via == "chain", (logs / "follow.log").read_text()[-2000:]
        assert 0 < report.read_bytes < size / 4
        assert "links=3" in (logs / "follow.log").read_text()
        assert not any(client.zcard(keys.leases(v)) for v in range(1, latest + 1))
        status = run_weightcast(env, "status")
        assert status.returncode == 0, status.stderr
        assert f"v{latest} (reported" in status.stdout and "by chain:" in status.stdout
    finally:
        follow.send_signal(signal.SIGCONT)
        for process in (publisher, follow):
            stop(process)
        client.close()
