"""The real Publisher against a real redis-server: quarantine, catch-up, the leader lock."""

from __future__ import annotations

import json
import shutil
import struct
import threading
from pathlib import Path

import pytest
import redis
import torch
from prometheus_client import generate_latest

from weightcast.contract.events import Published
from weightcast.contract.keys import Keys
from weightcast.contract.snapshot_format import (
    FORMAT_DCP_SAFETENSORS,
    FORMAT_DCP_TORCH_SAVE,
    INFO_NAME,
    SnapshotInfo,
)
from weightcast.contract.tensorfile import read_header
from weightcast.contract.version_info import VersionInfo
from weightcast.local.redis_server import RedisServer
from weightcast.runtime.net import free_port
from weightcast.runtime.settings import load_config
from weightcast_publisher.daemon import Publisher
from weightcast_publisher.registry import NOT_LEADER
from weightcast_publisher.watcher import SnapshotWatcher

from helpers.models import hf_state, shape_of
from helpers.processes import run_weightcast, wait_for
from helpers.snapshots import FORMATS, write_snapshot
from helpers.versions import publish_snapshot

SHAPE = shape_of(4, 2, 8, hidden=16, inter=32)


def make_publisher(redis_server: RedisServer, keys: Keys, root: Path, **publisher) -> Publisher:
    settings = {
        "redis_url": redis_server.url,
        "namespace": keys.namespace,
        "checkpoint_dir": root / "checkpoints",
        "weights_dir": root / "weights",
        **{f"publisher.{k}": v for k, v in publisher.items()},
    }
    return Publisher(load_config(env={}, overrides=settings))


def metric(publisher: Publisher, name: str) -> float:
    for line in generate_latest(publisher.metrics.registry).decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def data_file(path: Path) -> Path:
    info = SnapshotInfo.read(path)
    return path / (info.files[0].name if info.files else "__0_0.distcp")


def truncate_data(path: Path) -> None:
    data = data_file(path)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def garble_metadata(path: Path) -> None:
    """The old format's pickled .metadata, or the new format's safetensors header."""
    if SnapshotInfo.read(path).format == FORMAT_DCP_TORCH_SAVE:
        (path / ".metadata").write_bytes(b"not a DCP metadata file")
    else:
        with open(data_file(path), "r+b") as f:
            f.write(struct.pack("<Q", 2**40))


def drop_config(path: Path) -> None:
    (path / "config.json").unlink()


def inconsistent_config(path: Path) -> None:
    (path / "config.json").write_text(json.dumps({**SHAPE.to_hf_config(), "hidden_size": 24}))


def rewrite(path: Path, state: dict) -> None:
    info = SnapshotInfo.read(path)
    shutil.rmtree(path)
    write_snapshot(path.parent, info.step, SHAPE, state, info.format)


def wrong_shapes(path: Path) -> None:
    state = hf_state(SHAPE, torch.bfloat16)
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:-1]
    rewrite(path, state)


def missing_tensor(path: Path) -> None:
    state = hf_state(SHAPE, torch.bfloat16)
    del state["model.layers.0.self_attn.q_proj.weight"]  # k and v are left with no partner
    rewrite(path, state)


def not_a_number(path: Path) -> None:
    """A NaN on disk (the trainer's writer refuses them; bit rot or another writer does not)."""
    state = hf_state(SHAPE, torch.bfloat16)
    if SnapshotInfo.read(path).format == FORMAT_DCP_TORCH_SAVE:
        state["model.norm.weight"][3] = float("nan")
        rewrite(path, state)
        return
    with open(data_file(path), "r+b") as f:
        span = next(
            s for s in read_header(f.fileno(), "data").tensors if s.name == "model.norm.weight"
        )
        f.seek(span.start + 6)
        f.write(b"\xc0\x7f")  # bf16 NaN


def deep_info(path: Path) -> None:
    """``weightcast.json`` nested past Python's recursion limit (json raises RecursionError)."""
    (path / INFO_NAME).write_text("[" * 100_000)


DAMAGE = {
    truncate_data: {
        FORMAT_DCP_TORCH_SAVE: "truncated",
        FORMAT_DCP_SAFETENSORS: "bytes, weightcast",
    },
    garble_metadata: {
        FORMAT_DCP_TORCH_SAVE: ".metadata unreadable",
        FORMAT_DCP_SAFETENSORS: "safetensors header claims 1099511627776 bytes",
    },
    drop_config: "incomplete: config.json missing",
    inconsistent_config: "the config implies",
    wrong_shapes: "up_proj.weight has shape [31, 16]; the config implies [32, 16]",
    missing_tensor: "k_proj.weight has no partner to fuse with",
    not_a_number: "non-finite weights: model.norm.weight holds NaN",
    deep_info: "weightcast.json unreadable: weightcast.json is not JSON",
}


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("reader", ["auto", "dcp-load"])
def test_corrupt_snapshots_are_quarantined_with_their_reason_and_the_daemon_carries_on(
    redis_server: RedisServer,
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    reader: str,
    format: str,
) -> None:
    publisher = make_publisher(redis_server, keys, tmp_path, reader=reader, keep_quarantined=2)
    checkpoints = tmp_path / "checkpoints"
    for step, damage in enumerate(DAMAGE, start=1):
        damage(write_snapshot(checkpoints, step, SHAPE, None, format))
        publisher.scan_once()
        assert client.get(keys.latest) is None, f"{damage.__name__} was published"

    reasons = [json.loads(v)["reason"] for v in client.hvals(keys.quarantine)]
    for expected in DAMAGE.values():
        if isinstance(expected, dict):
            expected = expected[format]
        if reader == "dcp-load" and expected.startswith("safetensors header"):
            expected = "unreadable"  # safetensors' own reader says it its way
        assert any(expected in reason for reason in reasons), (expected, reasons)
    assert metric(publisher, "weightcast_snapshots_quarantined_total") == len(DAMAGE)
    outcomes = {v.decode() for v in client.hvals(keys.snapshots)}
    assert outcomes == {"quarantined"}
    kept = sorted((checkpoints / "quarantine").iterdir())
    assert len(kept) == 2  # older quarantined snapshots pruned
    assert all((k / "REASON.txt").read_text().strip() for k in kept)
    assert not [p for p in checkpoints.iterdir() if p.name.startswith("step-")]

    write_snapshot(checkpoints, 10, SHAPE, None, format)
    publisher.scan_once()
    latest = int(client.get(keys.latest))
    assert [p.name for p in (tmp_path / "weights").iterdir()] == [f"v{latest}"]
    # The registry names the version relative to the weights directory; so do its events.
    assert client.hget(keys.version(latest), "path") == f"v{latest}".encode()


def test_when_behind_only_the_newest_snapshot_is_published(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    publisher = make_publisher(redis_server, keys, tmp_path)
    checkpoints = tmp_path / "checkpoints"
    for step in range(1, 11):
        write_snapshot(checkpoints, step, SHAPE)
    publisher.scan_once()

    assert [int(v) for v in client.zrange(keys.versions, 0, -1)] == [1]
    assert int(client.hget(keys.version(1), "step")) == 10
    outcomes = sorted(v.decode() for v in client.hvals(keys.snapshots))
    assert outcomes == ["1"] + ["skipped"] * 9
    assert metric(publisher, "weightcast_snapshots_skipped_total") == 9
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-10", "step-9"]


def test_only_the_lock_holder_publishes_and_registers(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    leader = make_publisher(redis_server, keys, tmp_path, leader_ttl_seconds=30)
    standby = make_publisher(redis_server, keys, tmp_path, leader_ttl_seconds=30)
    assert leader.ensure_leader()
    assert not standby.ensure_leader()
    write_snapshot(tmp_path / "checkpoints", 1, SHAPE)
    standby.scan_once()
    assert client.get(keys.latest) is None and not list((tmp_path / "weights").iterdir())

    # A paused ex-leader whose lock was taken over cannot register what it converted.
    entry = VersionInfo(
        version=7, path="x", step=1, layout="vllm-fused", tp=1, dtype="bfloat16", bytes=0,
        manifest_sha256="0" * 64, run_id="r", created_at=0.0, snapshot_id="snap",
    )  # fmt: skip
    event = Published(7, 1, 0.0, "x", "snap")
    assert standby.registry.register(entry, event, standby.lock.holder) == NOT_LEADER
    assert not client.exists(keys.version(7))
    leader.scan_once()
    assert int(client.get(keys.latest)) == 1
    leader.lock.release()
    assert standby.ensure_leader()


@pytest.mark.parametrize("poll", [False, True])
def test_the_watcher_wakes_on_a_new_snapshot(tmp_path: Path, poll: bool) -> None:
    watcher = SnapshotWatcher(tmp_path, poll=poll)
    watcher.start()
    try:
        assert not watcher.wait(0.2)
        (tmp_path / "step-1").mkdir()
        assert watcher.wait(10)  # PollingObserver checks every second
    finally:
        watcher.stop()


def test_a_lost_event_still_leads_to_a_publish_at_the_next_rescan(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    """Events can be lost (an inotify overflow, a network filesystem): the rescan finds it."""
    publisher = make_publisher(redis_server, keys, tmp_path, rescan_seconds=0.5)
    events = client.pubsub()
    events.subscribe(keys.events)
    runner = threading.Thread(target=publisher.run)
    runner.start()
    try:
        wait_for(lambda: publisher.lock.held and publisher.watcher, 30, "the publisher to lead")
        assert publisher.watcher is not None
        publisher.watcher.observer.unschedule_all()  # from now on every event is lost
        publish_snapshot(tmp_path / "checkpoints", 1, SHAPE)
        wait_for(lambda: client.get(keys.latest), 30, "the version")
    finally:
        publisher.stop()
        runner.join(30)
    assert not runner.is_alive()
    published = [
        json.loads(m["data"])
        for m in iter(lambda: events.get_message(timeout=1), None)
        if m["type"] == "message"
    ]
    assert [(e["event"], e["path"]) for e in published] == [("published", "v1")]


def test_a_trainer_resuming_from_an_older_step_gets_a_new_version_number(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    publisher = make_publisher(redis_server, keys, tmp_path)
    checkpoints = tmp_path / "checkpoints"
    write_snapshot(checkpoints, 10, SHAPE)
    publisher.scan_once()
    shutil.rmtree(checkpoints / "step-10")
    write_snapshot(checkpoints, 6, SHAPE)  # resumed from step 5, a newer snapshot of step 6
    publisher.scan_once()
    assert [int(v) for v in client.zrange(keys.versions, 0, -1)] == [1, 2]
    assert int(client.hget(keys.version(2), "step")) == 6
    assert int(client.get(keys.latest)) == 2


def test_a_tp_the_model_cannot_take_stops_the_publisher_with_the_reason(
    cli_env: dict[str, str], client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    snapshot = write_snapshot(tmp_path / "checkpoints", 1, SHAPE)
    result = run_weightcast(cli_env, "publisher", "--once", "--tp", "8")
    assert result.returncode == 2
    assert "publisher.tp=8 cannot serve the model" in result.stderr
    assert "does not divide the 4 attention heads" in result.stderr
    assert snapshot.is_dir() and not client.hlen(keys.snapshots)  # kept for a fixed publisher


def test_healthz_says_unhealthy_when_redis_is_gone_or_the_loop_is_stuck(
    redis_server: RedisServer, keys: Keys, tmp_path: Path
) -> None:
    publisher = make_publisher(redis_server, keys, tmp_path)
    assert publisher.health().ok
    publisher.last_tick -= 3600  # the loop has not come round for an hour
    stuck = publisher.health()
    assert not stuck.ok and stuck.detail["seconds_since_loop"] >= 3600

    settings = {"redis_url": f"redis://127.0.0.1:{free_port()}/0", "namespace": keys.namespace}
    orphan = Publisher(load_config(env={}, overrides=settings))
    gone = orphan.health()
    assert not gone.ok and gone.detail["redis"].startswith("unreachable")
