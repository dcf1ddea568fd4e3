"""A tensor-parallel rank reads its own bytes and next to nothing else: at tp 8, at most
1.15x what it holds (format 3 stores each rank's row-parallel columns contiguously; format 2
made every rank read ``o_proj`` and ``down_proj`` whole)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import redis

from weightcast.contract.keys import Keys
from weightcast.contract.sharding import ShardKind
from weightcast.local.redis_server import RedisServer

from helpers.models import shape_of
from helpers.versions import Deployment

TP = 8
SHAPE = dataclasses.replace(shape_of(8, 8, 32, hidden=256, inter=1024, tied=False), vocab_size=1024)
"""8 heads and 8 kv heads of 32 (tp 8 splits both), a 1024-token vocabulary."""


def test_a_tp_8_rank_reads_at_most_1_15x_its_own_bytes(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> None:
    deployment = Deployment(client, keys, tmp_path, redis_server.url, tp=TP, shape=SHAPE)
    version = deployment.publish()
    reader = deployment.reader()
    manifest = reader.manifest(version)
    kinds = {t.name.rsplit(".", 2)[-2]: t.shard.kind for t in manifest.tensors}
    assert kinds["o_proj"] == kinds["down_proj"] == ShardKind.ROW_PARALLEL_RANKS
    total = sum(f.bytes for f in manifest.files if f.name.endswith(".vllm-fused"))
    for rank in range(TP):
        parts = reader.rank_tensors(version, rank, TP)
        own = sum(t.nbytes for t in parts.values())
        read = reader.reader.stats.bytes_read
        assert own <= read <= 1.15 * own, f"rank {rank} read {read} bytes for its {own}"
        assert read < total / 4
