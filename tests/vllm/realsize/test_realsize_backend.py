"""A CPU ``vllm.LLM`` with the weightcast backend walks the 0.6B versions (``helpers.realsize``)
from a bucket: each update through ranged GETs and staging windows of 1.2 GB versions, by
full read, delta and chain, a corrupt version refused with the engine still serving the
one before, and back to an older version. After every update the engine generates what a
fresh stock engine started from that version generates."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from weightcast.client.vllm.engine import EngineError, swap
from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.client.vllm.protocol import REFUSED as REFUSED_REPLY

from helpers.realsize import REFUSED, SERVED, WALK, RealSizeVersions
from vllm_helpers import Registry, backend_engine, greedy


def walk(engine: LocalEngine, versions: RealSizeVersions, fresh: dict[int, Any]) -> None:
    """Take ``engine`` through :data:`helpers.realsize.WALK`; ``fresh``: each served version's
    fresh-engine outputs."""
    from weightcast.client.vllm.backend import report

    held = 0
    for step in WALK:
        if step.via == REFUSED:
            with pytest.raises(EngineError, match=REFUSED_REPLY):
                swap(engine, step.version)
        else:
            swap(engine, step.version)
            held = step.version
            reports = engine.llm.collective_rpc(report)
            assert {(r["version"], r["via"]) for r in reports} == {(held, step.via)}, step
        assert engine.weight_version() == str(held)
        assert greedy(engine.llm) == fresh[held], step


def registry_of(versions: RealSizeVersions) -> Registry:
    """The registry of the versions, as the engine helpers take it."""
    deployment = versions.deployment
    return Registry(deployment.redis_url, deployment.keys.namespace, deployment.root)


@pytest.fixture(scope="module")
def fresh_tp1(realsize: RealSizeVersions, fresh_outputs: Any) -> dict[int, Any]:
    """Before any engine of this module starts: two 0.6B engines at once are memory."""
    by_dir = fresh_outputs(1, [realsize.hf_dirs[v] for v in SERVED])
    return {v: by_dir[realsize.hf_dirs[v]] for v in SERVED}


@pytest.fixture(scope="module")
def bucket_engine(realsize: RealSizeVersions, fresh_tp1: dict[int, Any]) -> Iterator[LocalEngine]:
    with backend_engine(
        realsize.hf_dirs[1],
        registry_of(realsize),
        "realsize-bucket",
        weights_root=realsize.deployment.location,
    ) as engine:
        yield engine


def test_an_engine_on_a_bucket_walks_the_versions_and_equals_fresh_engines(
    bucket_engine: LocalEngine, realsize: RealSizeVersions, fresh_tp1: dict[int, Any]
) -> None:
    walk(bucket_engine, realsize, fresh_tp1)
