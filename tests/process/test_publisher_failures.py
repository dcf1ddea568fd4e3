"""The publisher process under real failures: SIGKILL at random moments, a second publisher
taking over, Redis restarted mid-stream, a full filesystem."""

from __future__ import annotations

import collections
import hashlib
import json
import random
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import redis
import torch

from weightcast.contract.keys import Keys
from weightcast.contract.manifest import Manifest, verify_files
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.snapshot_format import SnapshotInfo
from weightcast.local.redis_server import RedisServer
from weightcast.runtime.net import free_port

from helpers.files import tmpfs
from helpers.models import hf_state, shape_of
from helpers.processes import healthz, run_env, start_weightcast, stop
from helpers.versions import publish_snapshot

SMALL = shape_of(4, 2, 8, hidden=16, inter=32)
# About 95 MB in bf16: converting and fsyncing it takes long enough for kills to land in it.
CRASH_SHAPE = ModelShape(
    num_layers=12,
    hidden_size=512,
    intermediate_size=2048,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    vocab_size=1024,
    tie_word_embeddings=True,
)


class Daemon:
    """``weightcast publisher`` as a process with its log in a file."""

    def __init__(self, env: dict[str, str], log: Path, *args: str) -> None:
        self.log = log
        self.process = start_weightcast(env, log, "publisher", *args)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> int:
        return stop(self.process, timeout=30)

    def text(self) -> str:
        return self.log.read_text()


def wait_for(condition: Callable[[], object], what: str, daemon: Daemon, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert daemon.alive(), f"publisher exited while waiting for {what}:\n{daemon.text()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{daemon.text()}"
        time.sleep(0.1)
    return result


def env_for(url: str, keys: Keys, root: Path, **settings: object) -> dict[str, str]:
    """:func:`run_env` with ``publisher.<setting>`` values."""
    publisher = {f"WEIGHTCAST_PUBLISHER_{k.upper()}": str(v) for k, v in settings.items()}
    return run_env(url, keys.namespace, root) | publisher


def handled(client: redis.Redis, keys: Keys) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.snapshots).items()}


def snapshot_id(path: Path) -> str:
    return SnapshotInfo.read(path).snapshot_id


def assert_registered_versions_are_whole(
    client: redis.Redis, keys: Keys, weights: Path
) -> list[int]:
    live = [int(v) for v in client.zrange(keys.versions, 0, -1)]
    for version in live:
        path = client.hget(keys.version(version), "path").decode()
        assert path == f"v{version}"  # relative to the weights directory
        verify_files(weights / path, Manifest.read(weights / path))
    if live:
        assert int(client.get(keys.latest)) == live[-1]
    return live


def delta_only(client: redis.Redis, keys: Keys) -> list[int]:
    return [int(v) for v in client.zrange(keys.deltas, 0, -1)]


def new_temp_dirs(weights: Path, before: set[Path]) -> list[Path]:
    """Temp directories of conversions that were not there ``before``."""
    if not weights.exists():
        return []
    return [p for p in weights.iterdir() if p.name.startswith(".tmp") and p not in before]


def published_events(pubsub: redis.client.PubSub) -> list[dict]:
    events = []
    while message := pubsub.get_message(timeout=0.5):
        if message["type"] == "message":
            event = json.loads(message["data"])
            if event["event"] == "published":
                events.append(event)
    return events


def test_sigkill_at_random_moments_never_leaves_a_partial_or_duplicate_version(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    pubsub = client.pubsub()
    pubsub.subscribe(keys.events)
    env = env_for(redis_server.url, keys, tmp_path, rescan_seconds=0.2, leader_ttl_seconds=1)
    checkpoints, weights = tmp_path / "checkpoints", tmp_path / "weights"
    state = hf_state(CRASH_SHAPE, torch.bfloat16)
    rng = random.Random(4)
    left_behind: collections.Counter[str] = collections.Counter()
    ids = []
    kills = 22
    for step in range(1, kills + 1):
        ids.append(snapshot_id(publish_snapshot(checkpoints, step, CRASH_SHAPE, state)))
        before = set(weights.iterdir()) if weights.exists() else set()
        daemon = Daemon(env, tmp_path / f"publisher-{step}.log")
        if step % 4 == 0:  # a random moment of start-up
            time.sleep(rng.uniform(0.1, 2.0))
        elif step % 4 == 1:  # mid-conversion: its temp directory has appeared
            wait_for(lambda b=before: new_temp_dirs(weights, b), "a conversion", daemon)
        elif step % 4 == 2:  # registered: evicting, pruning, or already idle
            wait_for(lambda: ids[-1] in handled(client, keys), "the registration", daemon)
            time.sleep(rng.uniform(0.0, 0.3))
        else:  # a random moment once it leads: scanning, converting, fsyncing, registering
            wait_for(lambda d=daemon: "became the active publisher" in d.text(), "lead", daemon)
            time.sleep(rng.uniform(0.0, 0.8))
        daemon.kill()
        live = assert_registered_versions_are_whole(client, keys, weights)
        deltas = [str(v) for v in delta_only(client, keys)]
        for entry in weights.iterdir() if weights.exists() else []:
            kind = entry.name.split("-")[0].rstrip("0123456789")
            left_behind[
                kind
                if kind != "v"
                else "live v"
                if entry.name[1:] in map(str, live)
                else "delta-only v"
                if entry.name[1:] in deltas
                else "unregistered v"
            ] += 1
    # Kills mid-conversion left temp directories, kills after a registration live versions
    # (by construction, above); kills between the rename and the registration may leave a
    # whole but unregistered v<N>; evicted versions on the newest's chain of deltas stay
    # delta-only (publisher.delta_window), and a kill mid-trim leaves a .tmp-v<N>-delta-only
    # or an untrimmed one. Nothing else is ever left: no partial v<N>, no stray file.
    kinds = {".tmp", ".trash", "unregistered v", "live v", "delta-only v"}
    assert set(left_behind) <= kinds, left_behind
    assert left_behind[".tmp"] >= 1 and left_behind["live v"] >= 1, left_behind

    daemon = Daemon(env, tmp_path / "final.log")
    wait_for(lambda: "became the active publisher" in daemon.text(), "start-up", daemon)
    wait_for(lambda: ids[-1] in handled(client, keys), "the last snapshot", daemon)
    assert daemon.stop() == 0

    # No partial version anywhere: Redis names whole directories and only those exist.
    live = assert_registered_versions_are_whole(client, keys, weights)
    deltas = delta_only(client, keys)
    assert sorted(p.name for p in weights.iterdir()) == sorted(f"v{v}" for v in live + deltas)
    for version in deltas:  # trimmed (a trim a kill interrupted is finished at start), intact
        fields = client.hgetall(keys.version(version))
        delta = f"delta-from-v{int(fields[b'delta_from'])}.xor-sparse"
        names = {p.name for p in (weights / f"v{version}").iterdir()}
        assert names == {"manifest.json", "config.json", delta}
        text = (weights / f"v{version}" / "manifest.json").read_bytes()
        assert hashlib.sha256(text).hexdigest() == fields[b"manifest_sha256"].decode()
    assert not [p for p in checkpoints.iterdir() if p.name.startswith((".trash-", ".tmp-"))]

    # Each snapshot published at most once, versions never repeat, the newest two kept.
    events = published_events(pubsub)
    versions = [e["version"] for e in events]
    published_ids = [e["snapshot_id"] for e in events]
    assert len(set(published_ids)) == len(published_ids)
    assert versions == sorted(set(versions))
    assert live == versions[-2:]
    outcomes = handled(client, keys)
    assert set(outcomes) == set(ids)
    for event in events:
        assert outcomes[event["snapshot_id"]] == str(event["version"])
    assert int(client.get(keys.next_version)) >= versions[-1]


def test_a_standby_takes_over_when_the_leader_is_killed(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    pubsub = client.pubsub()
    pubsub.subscribe(keys.events)
    env = env_for(redis_server.url, keys, tmp_path, rescan_seconds=0.3, leader_ttl_seconds=2)
    first = Daemon(env, tmp_path / "first.log")
    wait_for(lambda: client.get(keys.publisher_leader), "a leader", first)
    second = Daemon(env, tmp_path / "second.log")
    try:
        wait_for(lambda: "standing by" in second.text(), "the standby", second)
        publish_snapshot(tmp_path / "checkpoints", 1, SMALL)
        wait_for(lambda: client.get(keys.latest), "version 1", first)
        assert "published version" in first.text() and "published version" not in second.text()

        first.kill()
        publish_snapshot(tmp_path / "checkpoints", 2, SMALL)
        wait_for(lambda: int(client.get(keys.latest)) == 2, "the standby's version", second)
        assert "became the active publisher" in second.text()
        assert str(second.process.pid) in client.get(keys.publisher_leader).decode()
    finally:
        for daemon in (first, second):
            if daemon.alive():
                daemon.stop()
    events = published_events(pubsub)
    assert [e["version"] for e in events] == [1, 2]
    assert [e["step"] for e in events] == [1, 2]
    assert len({e["snapshot_id"] for e in events}) == 2


def test_a_redis_restart_mid_stream_is_ridden_out(keys: Keys, tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=True).start()
    client = redis.Redis.from_url(server.url)
    port = free_port()
    env = env_for(
        server.url,
        keys,
        tmp_path,
        rescan_seconds=0.3,
        retry_max_seconds=1,
        leader_ttl_seconds=2,
        metrics_port=port,
    )
    daemon = Daemon(env, tmp_path / "publisher.log")
    checkpoints = tmp_path / "checkpoints"
    try:
        ids = [snapshot_id(publish_snapshot(checkpoints, 1, SMALL))]
        wait_for(lambda: client.get(keys.latest), "version 1", daemon)
        assert wait_for(lambda: healthz(port) == 200, "healthy", daemon)

        server.stop()
        wait_for(lambda: healthz(port) == 503, "unhealthy while Redis is down", daemon)
        ids += [snapshot_id(publish_snapshot(checkpoints, s, SMALL)) for s in (2, 3)]
        wait_for(lambda: daemon.text().count("Redis unreachable") >= 3, "retries", daemon)
        assert not [p for p in (tmp_path / "weights").iterdir() if p.name.startswith(".tmp")]

        server.start()
        wait_for(lambda: ids[-1] in handled(client, keys), "the pending snapshot", daemon)
        wait_for(lambda: healthz(port) == 200, "healthy again", daemon)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            metrics = reply.read().decode()
        assert 'weightcast_publisher_errors_total{kind="redis"}' in metrics
        assert 'weightcast_versions_published_total{reader="byte-range"} 2.0' in metrics
        assert "weightcast_publish_lag_seconds_count 2.0" in metrics
        assert daemon.stop() == 0
        outcomes = handled(client, keys)
        assert outcomes[ids[0]] == "1" and outcomes[ids[1]] == "skipped"
        assert int(outcomes[ids[2]]) > 1
        live = assert_registered_versions_are_whole(client, keys, tmp_path / "weights")
        assert live == [1, int(outcomes[ids[2]])]
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == [f"v{v}" for v in live]
    finally:
        if daemon.alive():
            daemon.kill()
        server.stop()


def test_a_full_disk_registers_nothing_and_retries_until_space_is_freed(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "weights", "2m") as weights:
        run_with_a_full_disk(redis_server, client, keys, tmp_path, weights)


def run_with_a_full_disk(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path, weights: Path
) -> None:
    shape = ModelShape(2, 256, 1024, 4, 2, 64, 1024, True)  # about 4.4 MB: does not fit
    env = env_for(redis_server.url, keys, tmp_path, rescan_seconds=0.3, retry_max_seconds=2)
    daemon = Daemon(env, tmp_path / "publisher.log")
    try:
        publish_snapshot(tmp_path / "checkpoints", 1, shape)
        wait_for(lambda: daemon.text().count("filesystem error") >= 3, "retries", daemon)
        # The failed attempt removed its temp directory before it logged; the next one is
        # 2 s away (its back-off).
        assert client.get(keys.latest) is None
        assert list(weights.iterdir()) == []  # the temp directory was removed
        assert "No space left on device" in daemon.text()

        subprocess.run(["mount", "-o", "remount,size=64m", str(weights)], check=True)
        wait_for(lambda: client.get(keys.latest), "the version once space is freed", daemon)
        assert daemon.stop() == 0
        assert_registered_versions_are_whole(client, keys, weights)
        retries = [
            json.loads(line.split("retry_in=")[1].split()[0])
            for line in daemon.text().splitlines()
            if "filesystem error" in line
        ]
        assert retries[:3] == [0.5, 1.0, 2.0]  # exponential back-off, capped
    finally:
        if daemon.alive():
            daemon.kill()
