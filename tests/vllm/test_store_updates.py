"""A real CPU ``vllm.LLM`` whose ``weightcast`` backend reads versions from a bucket of a real
S3 server (SeaweedFS): the workers fetch their byte ranges by ranged GETs, verify them, load
by delta when they hold the base, and the engine then equals fresh engines exactly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.local.s3_server import S3Server
from weightcast.store.s3 import S3Location, S3Store

from conftest import Versions
from helpers.s3 import unique_bucket
from vllm_helpers import backend_engine, greedy


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
