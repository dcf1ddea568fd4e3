"""Delta versions end to end with the real publisher: a node that keeps its base reads only
the delta's frames of its own blocks, ends bitwise equal to reading each version in full,
and reads the full version (saying why) when the delta is damaged, its base differs or it
skipped a version."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import redis
import torch

from weightcast.client.weights import WeightsClient
from weightcast.contract.keys import Keys
from weightcast.contract.manifest import Manifest
from weightcast.local.redis_server import RedisServer

from helpers import Deployment, drift, hf_state, shape_of, write_snapshot

TP = 2
SHAPE = dataclasses.replace(shape_of(8, 8, 32, hidden=256, inter=1024, tied=False), vocab_size=1024)


class Run:
    """The real publisher (tp 2, deltas on) fed snapshots that drift like small RL steps."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.state = hf_state(SHAPE, torch.bfloat16)
        self.step = 0

    def publish(self) -> int:
        self.step += 1
        if self.step > 1:
            drift(self.state, self.step)
        root = self.deployment.root
        write_snapshot(root / "checkpoints", self.step, SHAPE, self.state)
        self.deployment.publisher.scan_once()
        return int(self.deployment.client.get(self.deployment.keys.latest))

    def manifest(self, version: int) -> Manifest:
        return Manifest.read(self.deployment.root / "weights" / f"v{version}")


@pytest.fixture
def run(client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer) -> Run:
    return Run(Deployment(client, keys, tmp_path, redis_server.url, tp=TP, shape=SHAPE))


def keeping(run: Run) -> WeightsClient:
    reader = run.deployment.reader()
    reader.files.keep_base = True
    return reader


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_chain_of_versions_by_delta_is_bitwise_the_full_versions(run: Run) -> None:
    nodes = {rank: keeping(run) for rank in range(TP)}
    whole, full = keeping(run), run.deployment.reader()
    for number in range(4):
        version = run.publish()
        manifest = run.manifest(version)
        info = run.deployment.client.hgetall(run.deployment.keys.version(version))
        if number:
            assert manifest.delta is not None and manifest.delta.base_version == version - 1
            assert int(info[b"delta_from"]) == version - 1
            assert int(info[b"delta_bytes"]) == manifest.delta.bytes < manifest.total_bytes / 10
        for rank, node in nodes.items():
            mine = node.rank_tensors(version, rank, TP)
            assert same(mine, full.rank_tensors(version, rank, TP))
            stats = node.files.stats
            assert stats.via == ("delta" if number else "full"), stats.reason
            if number:
                assert stats.bytes_read < full.files.stats.bytes_read / 10
        assert same(whole.load(version), full.load(version))
        assert whole.files.stats.via == ("delta" if number else "full")


def flip_a_frame_byte(run: Run, version: int) -> None:
    manifest = run.manifest(version)
    assert manifest.delta is not None
    offset, length = next(f for f in manifest.delta.frames("model.vllm-fused") if f[1])
    path = run.deployment.root / "weights" / f"v{version}" / manifest.delta.file
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_corrupted_delta_byte_is_caught_and_the_full_version_read(run: Run) -> None:
    node, full = keeping(run), run.deployment.reader()
    node.rank_tensors(run.publish(), 0, TP)
    version = run.publish()
    flip_a_frame_byte(run, version)
    assert same(node.rank_tensors(version, 0, TP), full.rank_tensors(version, 0, TP))
    assert node.files.stats.via == "full"
    assert node.files.stats.reason.startswith("the delta failed: ")
    node.rank_tensors(run.publish(), 0, TP)  # the full read became the base again
    assert node.files.stats.via == "delta"


def test_a_damaged_base_fails_the_digest_check_and_the_full_version_is_read(run: Run) -> None:
    node, full = keeping(run), run.deployment.reader()
    node.rank_tensors(run.publish(), 1, TP)
    assert node.files.base is not None
    held = node.files.base.files["model.vllm-fused"]
    block = held.block(max(held.offsets))
    block[len(block) // 2] ^= 0x01  # memory gone bad: the rebuilt block cannot match
    version = run.publish()
    assert same(node.rank_tensors(version, 1, TP), full.rank_tensors(version, 1, TP))
    assert node.files.stats.via == "full"
    assert "rebuilt from the delta do not match the manifest's xxh3-128 digest" in (
        node.files.stats.reason
    )


def test_a_node_that_skipped_a_version_or_holds_another_part_reads_in_full(run: Run) -> None:
    node = keeping(run)
    first = run.publish()
    node.rank_tensors(first, 0, TP)
    run.publish()
    skipped = run.publish()
    node.rank_tensors(skipped, 0, TP)
    assert node.files.stats.via == "full"
    assert node.files.stats.reason == (
        f"the delta of version {skipped} is from version {skipped - 1}; "
        f"the node holds version {first}"
    )
    node.rank_tensors(run.publish(), 1, TP)
    assert node.files.stats.via == "full"
    assert "another part of the base" in node.files.stats.reason


def test_without_a_base_or_a_delta_the_node_reads_in_full(run: Run) -> None:
    node = keeping(run)
    version = run.publish()
    node.rank_tensors(version, 0, TP)
    assert (node.files.stats.via, node.files.stats.reason) == (
        "full",
        "the node holds no earlier version",
    )
    run.deployment.publisher.options = dataclasses.replace(
        run.deployment.publisher.options, delta=False
    )
    version = run.publish()
    assert run.manifest(version).delta is None
    node.rank_tensors(version, 0, TP)
    assert node.files.stats.reason == f"version {version} has no delta"


def test_a_delta_read_lands_in_host_memory_under_a_default_device_context(run: Run) -> None:
    """As a full read (test_weights_client): under ``torch.device("cuda")``, for which the
    meta device stands in here, the parts a delta rebuilds are still host tensors."""
    node, full = keeping(run), run.deployment.reader()
    node.rank_tensors(run.publish(), 0, TP)  # the base the node keeps
    version = run.publish()
    with torch.device("meta"):
        mine = node.rank_tensors(version, 0, TP)
    assert node.files.stats.via == "delta", node.files.stats.reason
    assert {t.device.type for t in mine.values()} == {"cpu"}
    assert same(mine, full.rank_tensors(version, 0, TP))


def test_a_delta_read_updates_the_tensors_the_node_holds_in_place(run: Run) -> None:
    """No copy: the tensors of the version the node holds are views of its base, and a read
    by delta turns them into the new version where they are (the same storage)."""
    node, full = keeping(run), run.deployment.reader()
    held = node.rank_tensors(run.publish(), 1, TP)
    pointers = {name: tensor.data_ptr() for name, tensor in held.items()}
    version = run.publish()
    mine = node.rank_tensors(version, 1, TP)
    assert node.files.stats.via == "delta", node.files.stats.reason
    assert {name: tensor.data_ptr() for name, tensor in mine.items()} == pointers
    assert same(held, full.rank_tensors(version, 1, TP))


def test_a_failed_delta_leaves_the_held_version_whole(run: Run) -> None:
    """Blocks rebuilt before the bad frame was met are changed back (XOR is its own
    inverse): the tensors the node holds are still, bitwise, the version it held."""
    node = keeping(run)
    first = run.publish()
    held = node.rank_tensors(first, 0, TP)
    before = {name: tensor.clone() for name, tensor in held.items()}
    version = run.publish()
    manifest = run.manifest(version)
    assert manifest.delta is not None
    frames = [f for f in manifest.delta.frames("model.vllm-fused") if f[1]]
    assert len(frames) > 4  # blocks before the bad one are rebuilt first
    path = run.deployment.root / "weights" / f"v{version}" / manifest.delta.file
    data = bytearray(path.read_bytes())
    offset, length = frames[-1]
    data[offset + length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    node.rank_tensors(version, 0, TP)
    assert node.files.stats.via == "full"
    assert same(held, before)
