"""Delta versions end to end with the real publisher: a node that keeps its base reads only
the delta's frames of its own blocks, ends bitwise equal to reading each version in full,
and reads the full version (saying why) when the delta is damaged, its base differs or it
skipped a version."""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
import zstandard

from weightcast.client.node import Node
from weightcast.client.reader import VersionReader
from weightcast.client.weights import WeightsClient
from weightcast.contract.delta import Delta, DeltaFile
from weightcast.contract.errors import WeightsError
from weightcast.contract.keys import Keys
from weightcast.contract.manifest import MANIFEST_NAME, Manifest, file_entry, sha256_bytes
from weightcast.contract.snapshot_format import CONFIG_NAME
from weightcast.local.redis_server import RedisServer

from helpers.memory import peak_traced
from helpers.models import drift, hf_state, shape_of
from helpers.snapshots import write_snapshot
from helpers.versions import Deployment, same

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


def keeping(run: Run, max_delta_chain: int = 16) -> WeightsClient:
    return run.deployment.reader(keep_base=True, max_delta_chain=max_delta_chain)


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
            stats = node.reader.stats
            assert stats.via == ("delta" if number else "full"), stats.reason
            if number:
                assert stats.bytes_read < full.reader.stats.bytes_read / 10
        assert same(whole.load(version), full.load(version))
        assert whole.reader.stats.via == ("delta" if number else "full")


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
    assert node.reader.stats.via == "full"
    assert node.reader.stats.reason.startswith("the delta failed: ")
    node.rank_tensors(run.publish(), 0, TP)  # the full read became the base again
    assert node.reader.stats.via == "delta"


def test_a_damaged_base_fails_the_digest_check_and_the_full_version_is_read(run: Run) -> None:
    node, full = keeping(run), run.deployment.reader()
    node.rank_tensors(run.publish(), 1, TP)
    assert node.reader.base is not None
    held = node.reader.base.files["model.vllm-fused"]
    block = held.block(max(held.offsets))
    block[len(block) // 2] ^= 0x01  # memory gone bad: the rebuilt block cannot match
    version = run.publish()
    assert same(node.rank_tensors(version, 1, TP), full.rank_tensors(version, 1, TP))
    assert node.reader.stats.via == "full"
    assert "rebuilt from the delta do not match the manifest's xxh3-128 digest" in (
        node.reader.stats.reason
    )


def test_a_node_that_skipped_a_version_or_holds_another_part_reads_in_full(run: Run) -> None:
    node = keeping(run, max_delta_chain=1)  # one delta at most: no chain over a skipped version
    first = run.publish()
    node.rank_tensors(first, 0, TP)
    run.publish()
    skipped = run.publish()
    node.rank_tensors(skipped, 0, TP)
    assert node.reader.stats.via == "full"
    assert node.reader.stats.reason == (
        f"the delta of version {skipped} is from version {skipped - 1}; "
        f"the node holds version {first}; no chain of deltas: the chain from version "
        f"{first} is longer than 1 deltas"
    )
    node.rank_tensors(run.publish(), 1, TP)
    assert node.reader.stats.via == "full"
    assert "another part of the base" in node.reader.stats.reason


def test_without_a_base_or_a_delta_the_node_reads_in_full(run: Run) -> None:
    node = keeping(run)
    version = run.publish()
    node.rank_tensors(version, 0, TP)
    assert (node.reader.stats.via, node.reader.stats.reason) == (
        "full",
        "the node holds no earlier version",
    )
    run.deployment.publisher.publishing.options = dataclasses.replace(
        run.deployment.publisher.publishing.options, delta=False
    )
    version = run.publish()
    assert run.manifest(version).delta is None
    node.rank_tensors(version, 0, TP)
    assert node.reader.stats.reason == f"version {version} has no delta"


def test_a_full_read_lets_go_of_the_held_version_before_it_reads(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node keeping its base that reads a version in full (no delta from its base) holds
    one version at a time, not two: the blocks it held are released before the new ones are
    read, so its peak is one version's bytes (issue 35: at 8B, two would be 32 GB)."""
    node = keeping(run)
    node.rank_tensors(run.publish(), 0, TP)  # the base, its tensors dropped (on the GPU)
    assert node.reader.base is not None
    held = [weakref.ref(f.data) for f in node.reader.base.files.values()]
    alive_at_read = []
    read_file = VersionReader._read_file

    def reading(self: VersionReader, *args: Any, **kwargs: Any) -> Any:
        gc.collect()
        alive_at_read.append(any(ref() is not None for ref in held))
        return read_file(self, *args, **kwargs)

    monkeypatch.setattr(VersionReader, "_read_file", reading)
    run.deployment.publisher.publishing.options = dataclasses.replace(
        run.deployment.publisher.publishing.options, delta=False
    )
    node.rank_tensors(run.publish(), 0, TP)
    assert node.reader.stats.via == "full"
    assert alive_at_read and not any(alive_at_read)


def test_a_delta_read_lands_in_host_memory_under_a_default_device_context(run: Run) -> None:
    """As a full read (test_weights_client): under ``torch.device("cuda")``, for which the
    meta device stands in here, the parts a delta rebuilds are still host tensors."""
    node, full = keeping(run), run.deployment.reader()
    node.rank_tensors(run.publish(), 0, TP)  # the base the node keeps
    version = run.publish()
    with torch.device("meta"):
        mine = node.rank_tensors(version, 0, TP)
    assert node.reader.stats.via == "delta", node.reader.stats.reason
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
    assert node.reader.stats.via == "delta", node.reader.stats.reason
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
    assert node.reader.stats.via == "full"
    assert same(held, before)


# -- a damaged or hostile delta: bounded, all or nothing, a fallback ---------------------------

WEIGHTS_FILE = "model.vllm-fused"


class Hostile:
    """Version ``version`` as someone who can write the weights directory and Redis leaves it
    (every digest and ``manifest_sha256`` recomputed): frames of the weights file replaced,
    the manifest changed, then registered; :meth:`restore` puts the genuine version back."""

    def __init__(self, run: Run, version: int) -> None:
        self.run, self.version = run, version
        self.directory = run.deployment.root / "weights" / f"v{version}"
        self.manifest = run.manifest(version)
        assert self.manifest.delta is not None
        self.delta_path = self.directory / self.manifest.delta.file
        self.saved = {p: p.read_bytes() for p in (self.directory / MANIFEST_NAME, self.delta_path)}

    def changed_blocks(self) -> list[int]:
        """The weights file's blocks with a frame (changed since the base)."""
        assert self.manifest.delta is not None
        return [i for i, (_, n) in enumerate(self.manifest.delta.frames(WEIGHTS_FILE)) if n]

    def frame(self, index: int) -> bytes:
        assert self.manifest.delta is not None
        offset, length = self.manifest.delta.frames(WEIGHTS_FILE)[index]
        return self.saved[self.delta_path][offset : offset + length]

    def write(
        self,
        frames: dict[int, bytes] | None = None,
        change: Callable[[Manifest], Manifest] | None = None,
    ) -> None:
        manifest, delta = self.manifest, self.manifest.delta
        assert delta is not None
        if frames:
            pieces, files = [], []
            for entry in delta.files:
                lengths = []
                for index, (offset, length) in enumerate(delta.frames(entry.name)):
                    old = self.saved[self.delta_path][offset : offset + length]
                    frame = frames.get(index, old) if entry.name == WEIGHTS_FILE else old
                    pieces.append(frame)
                    lengths.append(len(frame))
                files.append(DeltaFile(entry.name, lengths))
            self.delta_path.write_bytes(b"".join(pieces))
            delta = dataclasses.replace(delta, files=files)
            listed = [
                file_entry(self.delta_path) if f.name == delta.file else f for f in manifest.files
            ]
            manifest = dataclasses.replace(manifest, delta=delta, files=listed)
        if change is not None:
            manifest = change(manifest)
        self.register(manifest.to_json().encode())

    def register(self, text: bytes) -> None:
        (self.directory / MANIFEST_NAME).write_bytes(text)
        self.run.deployment.client.hset(
            self.run.deployment.keys.version(self.version), "manifest_sha256", sha256_bytes(text)
        )

    def restore(self) -> None:
        for path, data in self.saved.items():
            path.write_bytes(data)
        self.register(self.saved[self.directory / MANIFEST_NAME])


def size_field(frame: bytes) -> tuple[int, int]:
    """Where a zstd frame's header holds its content size: (offset, width)."""
    descriptor = frame[4]
    single = bool(descriptor & 0x20)
    width = {0: int(single), 1: 2, 2: 4, 3: 8}[descriptor >> 6]
    assert width, "the publisher writes the content size"
    return 5 + (not single) + (0, 1, 2, 4)[descriptor & 3], width


def declaring(frame: bytes, size: int) -> bytes:
    """``frame`` with its header's content size set to ``size`` (the field's width kept)."""
    at, width = size_field(frame)
    value = size - 256 if width == 2 else size
    return frame[:at] + value.to_bytes(width, "little") + frame[at + width :]


def flipped(frame: bytes) -> bytes:
    """``frame`` with the top bit of its content size flipped (a block of 256 bytes or more
    then declares at least 32 KiB more: gigabytes for a four-byte field)."""
    at, width = size_field(frame)
    return frame[: at + width - 1] + bytes([frame[at + width - 1] ^ 0x80]) + frame[at + width :]


def four_exbibytes() -> bytes:
    """An 18-byte zstd frame that declares 4 EiB: one RLE block of 128 KiB zeros."""
    header = (0xFD2FB528).to_bytes(4, "little") + bytes([0xE0]) + (4 << 60).to_bytes(8, "little")
    rle = ((128 * 1024) << 3 | 1 << 1 | 1).to_bytes(3, "little")
    return header + rle + b"\0" + b"\0"


def bomb(size: int, declared: bool) -> bytes:
    """A small frame that really decompresses to ``size`` zero bytes."""
    writer = zstandard.ZstdCompressor(level=1).compressobj(size=size if declared else -1)
    chunk = bytes(1 << 20)
    return b"".join(writer.compress(chunk) for _ in range(size >> 20)) + writer.flush()


HOSTILE_FRAMES: dict[str, Callable[[bytes], bytes]] = {
    "an 18-byte frame that declares 4 EiB": lambda frame: four_exbibytes(),
    "a flipped bit in the content size field": flipped,
    "a 16 KB frame that declares 512 MiB and holds them": lambda frame: bomb(512 << 20, True),
    "a 16 KB frame that holds 512 MiB undeclared": lambda frame: bomb(512 << 20, False),
    "a frame one byte short of its block": lambda frame: declaring(
        frame, zstandard.get_frame_parameters(frame).content_size - 1
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_FRAMES))
def test_a_frame_that_holds_or_declares_more_than_its_block_costs_only_the_block(
    run: Run, case: str
) -> None:
    """Refused as a damaged delta before anything is sized by it: the full version is read,
    the node's memory grows by a few blocks at most, and the next version is read by delta."""
    node, full = keeping(run), run.deployment.reader()
    node.rank_tensors(run.publish(), 0, TP)
    version = run.publish()
    hostile = Hostile(run, version)
    damage = HOSTILE_FRAMES[case]  # every changed frame: whichever blocks rank 0 holds
    hostile.write(frames={i: damage(hostile.frame(i)) for i in hostile.changed_blocks()})
    peak = peak_traced(lambda: node.rank_tensors(version, 0, TP))
    assert node.reader.stats.via == "full"
    assert node.reader.stats.reason.startswith("the delta failed: "), node.reader.stats.reason
    assert peak < 96 << 20, f"{peak / 2**20:.0f} MiB"  # the full read's windows, no bomb
    assert same(node.rank_tensors(version, 0, TP), full.rank_tensors(version, 0, TP))
    node.rank_tensors(run.publish(), 0, TP)
    assert node.reader.stats.via == "delta", node.reader.stats.reason


def dtype_lie(manifest: Manifest) -> Manifest:
    """A bfloat16 tensor listed as float16 (same size: the manifest parses)."""
    tensors = [
        dataclasses.replace(t, dtype="float16") if t.name == "model.norm.weight" else t
        for t in manifest.tensors
    ]
    return dataclasses.replace(manifest, tensors=tensors)


def shape_lie(manifest: Manifest) -> Manifest:
    """The embedding's two dimensions swapped (same size)."""
    tensors = [
        dataclasses.replace(t, shape=t.shape[::-1]) if t.name == "lm_head.weight" else t
        for t in manifest.tensors
    ]
    return dataclasses.replace(manifest, tensors=tensors)


def renamed(manifest: Manifest) -> Manifest:
    """A tensor listed under a name its file's header does not have."""
    tensors = [
        dataclasses.replace(t, name=t.name + ".x") if t.name == "model.norm.weight" else t
        for t in manifest.tensors
    ]
    return dataclasses.replace(manifest, tensors=tensors)


REFUSALS = {
    "a dtype lie": (dtype_lie, "tensor model.norm.weight is missing or not float16"),
    "a shape lie": (shape_lie, "tensor lm_head.weight is missing or not bfloat16"),
    "a tensor the file does not hold": (renamed, "tensor model.norm.weight.x is missing"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_version_refused_after_its_delta_applies_leaves_the_held_tensors_as_they_were(
    run: Run, case: str
) -> None:
    """The new header and tensor parts are checked on the rebuilt blocks, which are changed
    back when they fail: the refused version changes nothing the node holds, and once the
    version is put right it reads by delta."""
    change, message = REFUSALS[case]
    node, full = keeping(run), run.deployment.reader()
    first = run.publish()
    held = node.rank_tensors(first, 0, TP)
    before = {name: tensor.clone() for name, tensor in held.items()}
    version = run.publish()
    hostile = Hostile(run, version)
    hostile.write(change=change)
    with pytest.raises(WeightsError, match=re.escape(message)):
        node.rank_tensors(version, 0, TP)
    assert same(held, before)
    assert node.reader.base is not None and node.reader.base.version == first
    hostile.restore()
    assert same(node.rank_tensors(version, 0, TP), full.rank_tensors(version, 0, TP))
    assert node.reader.stats.via == "delta", node.reader.stats.reason


@pytest.mark.parametrize("damage", ["truncated", "missing", "longer"])
def test_a_damaged_or_missing_delta_file_makes_the_node_read_the_full_version(
    run: Run, damage: str
) -> None:
    node, full = keeping(run), run.deployment.reader()
    node.rank_tensors(run.publish(), 1, TP)
    version = run.publish()
    path = Hostile(run, version).delta_path
    if damage == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    elif damage == "missing":
        path.unlink()
    else:
        with open(path, "ab") as f:
            f.write(b"\0" * 64)
    assert same(node.rank_tensors(version, 1, TP), full.rank_tensors(version, 1, TP))
    assert node.reader.stats.via == "full"
    stats = node.reader.stats
    assert stats.reason.startswith(f"the delta failed: {path}"), stats.reason
    node.rank_tensors(run.publish(), 1, TP)
    assert node.reader.stats.via == "delta", node.reader.stats.reason


def test_a_delta_in_a_format_the_node_does_not_know_makes_it_read_the_version_in_full(
    run: Run,
) -> None:
    """A newer publisher's delta format is a reason to read the version whole, not to refuse
    it: the manifest parses, the node says why it read in full, and follows the next delta
    it knows."""
    node, full = keeping(run), run.deployment.reader()
    node.rank_tensors(run.publish(), 0, TP)
    version = run.publish()
    newer = Hostile(run, version)
    newer.write(change=lambda m: dataclasses.replace(m, delta=renamed(m.delta, "xor-next")))
    assert same(node.rank_tensors(version, 0, TP), full.rank_tensors(version, 0, TP))
    assert (node.reader.stats.via, node.reader.stats.reason) == (
        "full",
        "the delta is xor-next, which this node does not read (it reads xor-sparse or xor-zstd)",
    )
    node.rank_tensors(run.publish(), 0, TP)
    assert node.reader.stats.via == "delta", node.reader.stats.reason


def renamed(delta: Delta | None, codec: str) -> Delta:
    assert delta is not None
    return dataclasses.replace(delta, codec=codec)


def test_a_version_refused_for_its_config_leaves_the_node_on_the_version_it_holds(
    run: Run,
) -> None:
    """The config is checked before the delta is applied: a version refused for it leaves
    the held base (and tensors) the version the node reports, and the next version still
    comes without a full read."""
    node, full = Node(keeping(run), report_every=60), run.deployment.reader()
    first = run.publish()
    loaded = node.load(first)
    assert loaded is not None
    before = {name: tensor.clone() for name, tensor in loaded.tensors.items()}
    refused = run.publish()
    config = run.deployment.root / "weights" / f"v{refused}" / CONFIG_NAME
    config.write_bytes(config.read_bytes().replace(b"{", b"{ ", 1))  # not the manifest's
    assert node.load(refused) is None
    assert (node.current, node.seen) == (first, refused)
    assert node.client.reader.base is not None and node.client.reader.base.version == first
    assert same(loaded.tensors, before)
    after = node.load(run.publish())
    assert after is not None and same(after.tensors, full.load(after.info))
    assert node.via == "chain", node.client.reader.stats.reason
