"""A tp=2 CPU engine (a vocabulary that is not a multiple of 64) updated through the backend.

Each worker reads only its rank's part (about half the bytes), from a shared fused file or
from its own per-rank file. A version one rank refuses (its own file is corrupt) is refused
by both before either touches a parameter, and the engine stays in sync: vLLM's executor
raises at the first failed rank it reads and would answer every later call with the stale
reply of the other (the backend lets only the last rank raise).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.local_engine import LocalEngine

from conftest import Versions, assert_refused_and_unchanged
from vllm_helpers import backend_engine, greedy


@pytest.fixture(scope="module")
def engine(odd: Versions, bind_tp2: None) -> Iterator[LocalEngine]:
    with backend_engine(odd.hf_dir("A"), odd.registry, "tp2-node", tp=2) as engine:
        yield engine


@pytest.fixture(scope="module")
def fresh(odd: Versions, fresh_outputs: Any) -> dict[str, Any]:
    by_dir = fresh_outputs(2, [odd.hf_dir(name) for name in "BC"])
    return {name: by_dir[odd.hf_dir(name)] for name in "BC"}


def test_each_rank_loads_its_part_and_the_engine_equals_fresh_ones(
    engine: LocalEngine, odd: Versions, fresh: dict[str, Any]
) -> None:
    from weightcast.client.vllm.backend import report

    total = sum(t.nbytes for t in odd.states["B"].values())
    for name in ("B", "C"):  # C has per-rank files
        swap(engine, odd.number[name])
        assert greedy(engine.llm) == fresh[name], name
        reports = engine.llm.collective_rpc(report)
        assert [r["rank"] for r in reports] == [0, 1]
        assert all(r["version"] == odd.number[name] for r in reports)
        # Only norms are read by both ranks; the vocabulary splits 512 + 488 rows.
        assert all(0.45 * total < r["bytes"] < 0.55 * total for r in reports), reports
        assert sum(r["bytes"] for r in reports) < 1.05 * total


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("B-tp1", r"rank 0: WeightsError: version \d+ is fused for tp=1; this engine runs tp=2"),
        # Only rank 1's file is corrupt: rank 0 staged its part fine and still touched nothing.
        ("C-rank1-corrupt", r"rank 0: ok; rank 1: WeightsError: .*model-rank-01-of-02"),
    ],
)
def test_a_version_any_rank_refuses_is_refused_by_every_rank(
    engine: LocalEngine, odd: Versions, fresh: dict[str, Any], name: str, reason: str
) -> None:
    assert_refused_and_unchanged(engine, odd, fresh, name, reason)
