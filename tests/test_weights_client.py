"""Readers against a real redis-server and real version directories: leases, checks, waits."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import redis

from publisher.daemon import Publisher
from shared.config import load_config
from shared.keys import Keys
from shared.manifest import verify_files
from shared.redis_server import RedisServer
from shared.weights_client import VersionGone, WeightsClient, WeightsError

from helpers import REPO, shape_of, write_snapshot

SHAPE = shape_of(4, 2, 8, hidden=16, inter=32)


class Deployment:
    """The real publisher, driven one snapshot at a time, plus readers of its versions."""

    def __init__(self, client: redis.Redis, keys: Keys, root: Path, redis_url: str) -> None:
        self.client, self.keys, self.root, self.redis_url = client, keys, root, redis_url
        settings = {
            "redis_url": redis_url,
            "namespace": keys.namespace,
            "checkpoint_dir": root / "checkpoints",
            "weights_dir": root / "weights",
        }
        self.publisher = Publisher(load_config(env={}, overrides=settings))
        self.registry, self.evictor = self.publisher.registry, self.publisher.evictor
        self.step = 0

    def publish(self) -> int:
        """Write the next snapshot and run one publisher pass: publish, evict, prune."""
        self.step += 1
        write_snapshot(self.root / "checkpoints", self.step, SHAPE)
        self.publisher.scan_once()
        return int(self.client.get(self.keys.latest))

    def reader(self, node_id: str = "node-a", lease_seconds: float = 30.0) -> WeightsClient:
        return WeightsClient(
            self.redis_url,
            self.keys.namespace,
            node_id,
            self.root / "weights",
            lease_seconds=lease_seconds,
        )


@pytest.fixture
def deployment(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> Deployment:
    return Deployment(client, keys, tmp_path, redis_server.url)


def test_a_leased_version_outlives_newer_versions_until_released(deployment: Deployment) -> None:
    deployment.publish()
    deployment.publish()
    reader = deployment.reader(lease_seconds=3.0)  # renewed by the client while held
    with reader.lease(1) as info:
        for _ in range(3):
            deployment.publish()
            time.sleep(1.5)  # held 4.5 s in all: alive only because it is renewed
        # Three newer versions and several eviction passes later v1 is still whole.
        assert 1 in deployment.registry.live_versions()
        manifest = reader.open(info)
        assert len(reader.load(info)) == len(manifest.tensors)
    assert deployment.registry.live_versions() == [1, 4, 5]
    deployment.evictor.run()
    assert deployment.registry.live_versions() == [4, 5]
    assert not (deployment.root / "weights" / "v1").exists()
    assert sorted(p.name for p in (deployment.root / "weights").iterdir()) == ["v4", "v5"]


def test_an_evicted_version_cannot_be_leased(deployment: Deployment) -> None:
    for _ in range(3):
        deployment.publish()
    with pytest.raises(VersionGone), deployment.reader().lease(1):
        pass


def test_the_lease_of_a_killed_reader_expires(
    deployment: Deployment, redis_server, keys: Keys
) -> None:
    deployment.publish()
    deployment.publish()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import time
        from shared.weights_client import WeightsClient
        client = WeightsClient(
            {redis_server.url!r}, {keys.namespace!r},
            "doomed-node", {str(deployment.root / "weights")!r}, lease_seconds=5,
        )
        with client.lease(1):
            print("leased", flush=True)
            time.sleep(600)
    """),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "leased"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    deployment.publish()
    assert 1 in deployment.registry.live_versions()  # the lease has not expired yet
    deadline = time.monotonic() + 20
    while 1 in deployment.registry.live_versions():
        assert time.monotonic() < deadline, "the dead reader's lease never expired"
        time.sleep(0.2)
        deployment.evictor.run()
    assert not (deployment.root / "weights" / "v1").exists()


def test_a_path_outside_the_weights_root_is_refused(deployment: Deployment, tmp_path: Path) -> None:
    deployment.publish()
    deployment.client.hset(deployment.keys.version(1), "path", str(tmp_path / "elsewhere"))
    reader = deployment.reader()
    with reader.lease(1) as info, pytest.raises(WeightsError, match="outside the weights root"):
        reader.open(info)


def test_a_corrupted_file_fails_verification_naming_the_file(deployment: Deployment) -> None:
    deployment.publish()
    weights = deployment.root / "weights" / "v1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    reader = deployment.reader()
    with reader.lease(1) as info, pytest.raises(WeightsError, match=r"model\.safetensors: sha256"):
        reader.open(info)


def test_wait_for_newer_wakes_on_the_event_and_survives_a_lost_one(
    deployment: Deployment,
) -> None:
    reader = deployment.reader()
    assert reader.wait_for_newer(0, timeout=0.3, poll=0.1) is None
    threading.Timer(0.3, deployment.publish).start()
    start = time.monotonic()
    assert reader.wait_for_newer(0, timeout=20, poll=10) == 1  # the pub/sub event wakes it
    assert time.monotonic() - start < 8
    # A version whose event never arrives (latest set without PUBLISH) is still found by polling.
    deployment.client.set(deployment.keys.latest, 2)
    assert reader.wait_for_newer(1, timeout=5, poll=0.2) == 2


def test_a_published_version_verifies_and_loads(deployment: Deployment) -> None:
    deployment.publish()
    reader = deployment.reader()
    assert reader.latest() == 1
    with reader.lease(1) as info:
        manifest = reader.open(info)
        verify_files(info.path, manifest)
        tensors = reader.load(info)
    assert "model.layers.0.self_attn.qkv_proj.weight" in tensors
    reader.report_loaded(1)
    assert b"node-a" in deployment.client.hkeys(deployment.keys.nodes)
    assert deployment.client.zcard(deployment.keys.leases(1)) == 0  # released on exit
