"""The publisher cuts digest blocks between tensor-parallel ranks' rows, so each rank of a
node reads and verifies its own bytes and not its neighbours'.

Versions are written by the real publisher daemon (one pass) and read by the real client;
what each rank should read is worked out independently, from the file's header and the
manifest's shard specs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch

from weightcast.contract.errors import WeightsError
from weightcast.contract.keys import Keys
from weightcast.contract.layout import FUSED_WEIGHTS_FILE
from weightcast.contract.manifest import BLOCK_BYTES, Manifest, digest_bytes
from weightcast.contract.model_shape import ModelShape
from weightcast.local.redis_server import RedisServer
from weightcast.store.directory import OpenFile
from weightcast_publisher.safetensors_writer import BUFFER_BYTES

from helpers.models import SMALL_GQA, rank_part, shape_of
from helpers.snapshots import write_snapshot
from helpers.versions import Deployment, rank_byte_ranges

WIDE = shape_of(16, 8, 128, hidden=1024, inter=3072)
"""Qwen3-0.6B's widths (two layers): 8 MiB qkv and 12 MiB gate_up tensors, a 60 MiB file
that spans several of the writer's buffers; tp 8 gives each rank 1 MiB of each qkv."""


def published(
    client: redis.Redis, keys: Keys, tmp_path: Path, url: str, shape: ModelShape, tp: int
) -> tuple[Deployment, int, Path]:
    deployment = Deployment(client, keys, tmp_path, url, tp=tp)
    write_snapshot(tmp_path / "checkpoints", 1, shape)
    deployment.publisher.scan_once()
    version = int(client.get(keys.latest))
    path = client.hget(keys.version(version), "path").decode()
    return deployment, version, tmp_path / "weights" / path


def own_bytes(directory: Path, rank: int, tp: int) -> list[tuple[int, int]]:
    """What ``rank`` needs of the fused file, as sorted disjoint ranges."""
    return merged(rank_byte_ranges(directory, rank, tp))


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


@pytest.mark.parametrize(("shape", "tp"), [(SMALL_GQA, 2), (SMALL_GQA, 4), (WIDE, 8)])
def test_each_rank_reads_exactly_its_own_bytes(
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    shape: ModelShape,
    tp: int,
) -> None:
    deployment, version, directory = published(client, keys, tmp_path, redis_server.url, shape, tp)
    reads: list[tuple[int, int]] = []
    read_into = OpenFile.read_into

    def recorded(self: OpenFile, buffers: list[memoryview], offset: int) -> None:
        if self.label.endswith(FUSED_WEIGHTS_FILE):
            reads.append((offset, offset + sum(len(b) for b in buffers)))
        read_into(self, buffers, offset)

    whole = deployment.reader().load(version)
    manifest = Manifest.read(directory)
    shards = {t.name: t.shard for t in manifest.tensors}
    monkeypatch.setattr(OpenFile, "read_into", recorded)
    for rank in range(tp):
        reads.clear()
        parts = deployment.reader(f"node-{rank}").rank_tensors(version, rank, tp)
        assert merged(reads) == own_bytes(directory, rank, tp), f"rank {rank}"
        for name, tensor in parts.items():
            assert torch.equal(tensor, rank_part(whole[name], shards[name], rank, tp)), name


def test_blocks_are_cut_between_ranks_within_the_writers_buffers(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> None:
    _, _, directory = published(client, keys, tmp_path, redis_server.url, WIDE, 8)
    (entry,) = [f for f in Manifest.read(directory).files if f.name == FUSED_WEIGHTS_FILE]
    blocks = entry.blocks
    assert blocks is not None and blocks.lengths is not None
    assert entry.bytes > 3 * BUFFER_BYTES
    assert all(0 < n <= BLOCK_BYTES for n in blocks.lengths)
    starts = set(blocks.starts)
    assert set(range(0, entry.bytes, BUFFER_BYTES)) <= starts  # none crosses a buffer
    for rank in range(8):
        for start, stop in own_bytes(directory, rank, 8):
            assert start in starts and stop in starts, f"rank {rank}: {start}..{stop}"
    data = (directory / FUSED_WEIGHTS_FILE).read_bytes()
    for index, digest in enumerate(blocks.digests):
        start, stop = blocks.span(index, entry.bytes)
        assert digest_bytes(blocks.algorithm, data[start:stop]) == digest


def test_tp_1_keeps_the_fixed_grid(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> None:
    _, _, directory = published(client, keys, tmp_path, redis_server.url, WIDE, 1)
    for entry in Manifest.read(directory).files:
        assert entry.blocks is not None and entry.blocks.lengths is None, entry.name


def test_a_corrupt_byte_in_one_ranks_rows_fails_that_rank_only(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> None:
    deployment, version, directory = published(
        client, keys, tmp_path, redis_server.url, SMALL_GQA, 2
    )
    rank_0, rank_1 = own_bytes(directory, 0, 2), own_bytes(directory, 1, 2)
    only_rank_1 = [
        offset
        for start, stop in rank_1
        for offset in range(start, stop)
        if not any(a <= offset < b for a, b in rank_0)
    ]
    path = directory / FUSED_WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[only_rank_1[len(only_rank_1) // 2]] ^= 0xFF
    path.write_bytes(bytes(data))
    assert len(deployment.reader("node-0").rank_tensors(version, 0, 2)) > 10
    with pytest.raises(WeightsError, match=r"model\.vllm-fused: bytes \d+\.\.\d+ do not match"):
        deployment.reader("node-1").rank_tensors(version, 1, 2)
