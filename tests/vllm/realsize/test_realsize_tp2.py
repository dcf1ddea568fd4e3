"""A tp=2 CPU ``vllm.LLM`` with the weightcast backend walks versions fused for tp 2 (the
walk of ``helpers.realsize``) from a bucket; each worker reads only its rank's part, by
ranged GETs, and after every update the engine generates what a fresh stock tp=2 engine
started from that version generates. (A rank's part read from a directory is the tiny
tier's ``test_tp2_updates``; the directory at real size is ``test_realsize_backend``'s.)

The versions are :data:`~helpers.realsize.WIDE`: 0.6B's widths and vocabulary in two layers.
Its tied embedding is 155 MB a rank (ten ranged GETs, several staging windows), as at 0.6B;
28 layers would make each of the five fresh tp=2 references a 0.6B engine of its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server

from helpers.realsize import WIDE, RealSizeVersions, published
from vllm_helpers import backend_engine
from walks import FreshOutputs, fresh_of, point_at, registry_of, walk


@pytest.fixture(scope="module")
def wide_tp2(
    redis_server: RedisServer, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealSizeVersions]:
    root = tmp_path_factory.mktemp("realsize-tp2")
    with published(redis_server.url, s3_server, root, root / "hf", WIDE, tp=2) as versions:
        yield versions


@pytest.fixture(scope="module")
def fresh_tp2(wide_tp2: RealSizeVersions, fresh_outputs: FreshOutputs) -> dict[int, Any]:
    return fresh_of(wide_tp2, fresh_outputs, 2)


@pytest.fixture(scope="module")
def engine(
    wide_tp2: RealSizeVersions, fresh_tp2: dict[int, Any], bind_tp2: None
) -> Iterator[LocalEngine]:
    with backend_engine(wide_tp2.hf_dirs[1], registry_of(wide_tp2), "realsize-tp2", tp=2) as engine:
        yield engine


def test_a_tp2_engine_walks_the_versions_from_a_bucket_and_equals_fresh_engines(
    engine: LocalEngine, wide_tp2: RealSizeVersions, fresh_tp2: dict[int, Any]
) -> None:
    point_at(engine, wide_tp2, "realsize-tp2-bucket", "bucket")
    walk(engine, fresh_tp2, tp=2)


def test_each_ranks_largest_part_spans_several_windows_and_ranged_gets(
    wide_tp2: RealSizeVersions,
) -> None:
    """What makes :data:`WIDE` a real-size shape: the embedding each rank reads is several
    read windows and many ranged GETs, as at 0.6B."""
    from weightcast.client.block_reads import WINDOW_BYTES
    from weightcast.store.s3 import PART_BYTES

    client = wide_tp2.deployment.reader()
    try:
        manifest = client.manifest(1)
    finally:
        client.close()
    embedding = next(t for t in manifest.tensors if t.name == "model.embed_tokens.weight")
    rank_bytes = embedding.shape[0] // 2 * embedding.shape[1] * 2  # bf16, vocabulary split
    assert rank_bytes > 2 * WINDOW_BYTES and rank_bytes > 8 * PART_BYTES, rank_bytes
