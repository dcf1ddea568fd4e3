"""A real CPU ``vllm.LLM`` whose ``weightcast`` backend reads versions from a bucket of a real
S3 server (SeaweedFS): the workers fetch their byte ranges by ranged GETs, verify them, load
by delta when they hold the base, and the engine then equals fresh engines exactly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.local.s3_server import S3Server
from weightcast.store.s3 import S3Location, S3Store

from conftest import Versions
from helpers.s3 import unique_bucket
from vllm_helpers import backend_engine, greedy, worker_resources


@pytest.fixture(scope="module")
def bucket_engine(tiny: Versions, s3_server: S3Server) -> Iterator[LocalEngine]:
    """A tp=1 engine started from A's HF layout, whose backend reads a bucket holding copies
    of the tiny versions (uploaded as the publisher uploads them), with the S3 server's
    client environment in this process and so in the engine's workers."""
    bucket = unique_bucket()
    s3_server.create_bucket(bucket)
    url = f"s3://{bucket}/run"
    options = f"?endpoint_url={s3_server.endpoint_url}&addressing_style=path"
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.client_env().items():
            env.setenv(name, value)
        store = S3Store(S3Location.parse(url + options))
        for name in "ABC":
            path = tiny.path(name)
            store.upload_version(path.name, path)
        store.close()
        with backend_engine(
            tiny.hf_dir("A"), tiny.registry, "bucket-node", weights_root=url + options
        ) as engine:
            yield engine


def test_an_engine_on_a_bucket_equals_fresh_engines_and_loads_by_delta(
    bucket_engine: LocalEngine, tiny: Versions, fresh_outputs: Any
) -> None:
    from weightcast.client.vllm.backend import report

    by_dir = fresh_outputs(1, [tiny.hf_dir(name) for name in "ABC"])
    for name, via in (("B", "full"), ("C", "delta")):
        swap(bucket_engine, tiny.number[name])
        assert greedy(bucket_engine.llm) == by_dir[tiny.hf_dir(name)], name
        (only,) = bucket_engine.llm.collective_rpc(report)
        assert (only["version"], only["via"]) == (tiny.number[name], via)
    assert all(tiny.registry.leases(v) == [] for v in tiny.number.values())


def test_an_engine_on_a_bucket_holds_nothing_more_after_50_updates(
    bucket_engine: LocalEngine, tiny: Versions, fresh_outputs: Any
) -> None:
    """50 updates round A, B, C (by delta forward, in full back to A): after 10 to warm up,
    the worker's threads and open files are what they were, its sockets within its
    bucket client's connection pool, the Redis server's connections no more, and its memory
    grew by less than 64 MiB (the backend once built a client and a store per update; a
    version or a store left behind per update would show 40 times over); the engine then
    still equals a fresh one."""
    from weightcast.client.vllm.backend import report

    observer = redis.Redis.from_url(tiny.registry.redis_url)
    seen: dict[str, int] = {}
    vias = set()
    for update in range(50):
        name = "ABC"[update % 3]
        swap(bucket_engine, tiny.number[name])
        (only,) = bucket_engine.llm.collective_rpc(report)
        vias.add(only["via"])
        if update in (9, 49):
            (worker,) = bucket_engine.llm.collective_rpc(worker_resources)
            now = {**worker, "redis_clients": len(observer.client_list())}
            seen = seen or now
    observer.close()
    end = now
    assert vias == {"full", "delta"}
    for kind in ("threads", "files", "redis_clients"):
        assert end[kind] <= seen[kind], (kind, seen, end)
    # The bucket client's pool opens sockets as its GETs first overlap, up to its 20.
    assert end["sockets"] <= seen["sockets"] + 20, (seen, end)
    assert end["rss"] - seen["rss"] < 64 << 20, (seen, end)
    fresh = fresh_outputs(1, [tiny.hf_dir("B")])
    swap(bucket_engine, tiny.number["B"])
    assert greedy(bucket_engine.llm) == fresh[tiny.hf_dir("B")]
