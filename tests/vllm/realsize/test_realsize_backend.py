"""A CPU ``vllm.LLM`` with the weightcast backend walks the 0.6B versions (``helpers.realsize``)
from the weights directory: each update through file reads and staging windows of 1.2 GB
versions, by full read, delta and chain, a corrupt version refused with the engine still
serving the one before, and back to an older version. After every update the engine
generates what a fresh stock engine started from that version generates.

The same backend reading the bucket (ranged GETs) at tp 1 is ``test_realsize_serve``'s walk:
``vllm serve`` runs this backend in its worker. A walk of each store here as well took about
two minutes more of CI's time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from weightcast.client.vllm.local_engine import LocalEngine

from helpers.realsize import RealSizeVersions
from vllm_helpers import backend_engine
from walks import FreshOutputs, fresh_of, point_at, registry_of, walk


@pytest.fixture(scope="module")
def fresh_tp1(realsize: RealSizeVersions, fresh_outputs: FreshOutputs) -> dict[int, Any]:
    """Before any engine of this module starts: two 0.6B engines at once are memory."""
    return fresh_of(realsize, fresh_outputs, 1)


@pytest.fixture(scope="module")
def engine(realsize: RealSizeVersions, fresh_tp1: dict[int, Any]) -> Iterator[LocalEngine]:
    with backend_engine(realsize.hf_dirs[1], registry_of(realsize), "realsize-tp1") as engine:
        yield engine


def test_an_engine_walks_the_versions_from_the_directory_and_equals_fresh_engines(
    engine: LocalEngine, realsize: RealSizeVersions, fresh_tp1: dict[int, Any]
) -> None:
    point_at(engine, realsize, "realsize-tp1-directory", "directory")
    walk(engine, fresh_tp1)
    deployment = realsize.deployment
    assert all(deployment.client.zcard(deployment.keys.leases(v)) == 0 for v in fresh_tp1)
