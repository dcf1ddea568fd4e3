"""The publisher keeps its Redis records bounded: nodes that stopped reporting age out after
``publisher.node_retention_seconds``; the newest ``publisher.keep_records`` snapshot and
quarantine records are kept, and never the record of a snapshot still on disk."""

from __future__ import annotations

import json
import time
from pathlib import Path

import redis

from weightcast.contract.keys import SNAPSHOT_SKIPPED, Keys
from weightcast.contract.nodes import NodeReport
from weightcast.local.redis_server import RedisServer
from weightcast.runtime.settings import load_config
from weightcast_publisher.daemon import Publisher
from weightcast_publisher.retention import (
    prune_nodes,
    prune_quarantine_records,
    prune_snapshot_records,
)

from helpers.models import shape_of
from helpers.snapshots import write_snapshot

SHAPE = shape_of(4, 2, 8, hidden=16, inter=32)


def test_nodes_silent_past_the_retention_and_unreadable_records_are_dropped(
    client: redis.Redis, keys: Keys
) -> None:
    now = time.time()
    client.hset(keys.nodes, "fresh", NodeReport(3, now - 5).encode())
    client.hset(keys.nodes, "quiet", NodeReport(2, now - 500, "v3 not loaded: no").encode())
    client.hset(keys.nodes, "gone-host-1234", NodeReport(1, now - 4000).encode())
    client.hset(keys.nodes, "garbage", "{")
    assert sorted(prune_nodes(client, keys, retention_s=3600)) == ["garbage", "gone-host-1234"]
    assert sorted(k.decode() for k in client.hkeys(keys.nodes)) == ["fresh", "quiet"]
    assert prune_nodes(client, keys, retention_s=3600) == []


def test_the_newest_snapshot_records_are_kept_and_those_on_disk_always(
    client: redis.Redis, keys: Keys
) -> None:
    for index in range(8):
        client.hset(keys.snapshots, f"s{index}", SNAPSHOT_SKIPPED)
        prune_snapshot_records(client, keys, keep=100, on_disk=set())  # one scan each
        time.sleep(0.01)
    dropped = prune_snapshot_records(client, keys, keep=3, on_disk={"s0"})
    assert dropped == ["s1", "s2", "s3", "s4"]
    assert sorted(k.decode() for k in client.hkeys(keys.snapshots)) == ["s0", "s5", "s6", "s7"]
    assert client.zcard(keys.snapshot_order) == 4  # the order follows the records


def test_the_newest_quarantine_records_are_kept(client: redis.Redis, keys: Keys) -> None:
    for index in range(6):
        entry = {"reason": "bad", "step": index, "path": f"q/{index}", "at": 1000.0 + index}
        client.hset(keys.quarantine, f"step-{index}", json.dumps(entry))
    client.hset(keys.quarantine, "unreadable", "[")
    dropped = prune_quarantine_records(client, keys, keep=4)
    assert sorted(dropped) == ["step-0", "step-1", "unreadable"]
    assert sorted(k.decode() for k in client.hkeys(keys.quarantine)) == [
        f"step-{index}" for index in range(2, 6)
    ]


def test_every_publisher_scan_prunes_with_the_settings(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    settings = {
        "redis_url": redis_server.url,
        "namespace": keys.namespace,
        "checkpoint_dir": tmp_path / "checkpoints",
        "weights_dir": tmp_path / "weights",
        "publisher.keep_records": 10,
        "publisher.node_retention_seconds": 60,
    }
    publisher = Publisher(load_config(env={}, overrides=settings))
    client.hset(keys.nodes, "restarted-host-1", NodeReport(1, time.time() - 61).encode())
    client.hset(keys.nodes, "alive", NodeReport(1, time.time()).encode())
    for index in range(15):
        client.hset(keys.snapshots, f"old-{index}", SNAPSHOT_SKIPPED)
    prune_snapshot_records(client, keys, keep=100, on_disk=set())  # an earlier scan saw them
    time.sleep(0.01)
    write_snapshot(tmp_path / "checkpoints", 1, SHAPE)
    publisher.scan_once()
    assert [k.decode() for k in client.hkeys(keys.nodes)] == ["alive"]
    assert client.hlen(keys.snapshots) == 10
    assert int(client.get(keys.latest)) == 1  # the one on disk was published and kept
    publisher.lock.release()
