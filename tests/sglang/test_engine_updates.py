"""A real CPU ``sglang.Engine`` kept on versions by an :class:`SglangNode`, against fresh
SGLang engines.

Versions come from the real publisher (``--layout hf``, with deltas). The engine under test
starts from version A's directory and is moved through B (read whole), C (by delta from B),
back to A, B again, a version that changes one tensor (only it handed to SGLang), and refused
versions (laid out for vLLM, another model, a corrupt block, block-FP8); after each step its
greedy tokens, their log-probabilities and the prompt's equal, exactly, those of an SGLang
engine started fresh from the version it should serve, which it also reports (as
``weight_version`` and in ``{wc}:nodes``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from weightcast.client.engine import REFUSED, VersionRefused
from weightcast.client.sglang.engine import SglangNode
from weightcast.client.sglang.local_engine import LocalSglangEngine
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.nodes import NodeReport

from conftest import TINY, stand_in_calls
from helpers.registry import Registry, Versions
from sglang_helpers import greedy, sglang_engine


@pytest.fixture(scope="module")
def node(tiny: Versions, fresh: dict[str, Any]) -> Iterator[SglangNode]:
    """An engine started from A's directory (after the fresh engines: one engine at a time),
    and its node."""
    client = tiny.registry.client("sg-0", keep_base=True)
    with sglang_engine(tiny.path("A")) as engine:
        node = SglangNode(LocalSglangEngine(engine), client, ModelShape.from_hf_config(TINY))
        yield node
        node.close()
    client.close()


def report(registry: Registry, node_id: str) -> NodeReport:
    client = redis.Redis.from_url(registry.redis_url)
    try:
        return NodeReport.parse(client.hget(registry.keys.nodes, node_id))
    finally:
        client.close()


def outputs(node: SglangNode) -> Any:
    return greedy(node.engine.engine)  # type: ignore[attr-defined]


def test_updates_equal_fresh_engines_exactly(
    node: SglangNode, tiny: Versions, fresh: dict[str, Any]
) -> None:
    assert outputs(node) == fresh["A"]  # started from A's directory
    assert fresh["A"] != fresh["B"] != fresh["C"]  # the versions differ where it shows
    # B: the node holds no base yet; C: its delta is from B; A: not from C, read whole again;
    # B: its delta is from A.
    for name, via in (("B", "full"), ("C", "delta"), ("A", "full"), ("B", "delta")):
        version = tiny.number[name]
        staged = node.load(version)
        assert staged.via == via, name
        assert staged.nbytes == sum(t.nbytes for t in tiny.states[name].values())
        assert outputs(node) == fresh[name], name
        assert node.engine.weight_version() == str(version)
        assert (report(tiny.registry, "sg-0").version, report(tiny.registry, "sg-0").via) == (
            version,
            via,
        )
        assert tiny.registry.leases(version) == ["sg-0"]  # held while served
        assert len(node.handed) == len(tiny.states[name])  # random versions: every tensor
    # B-norm differs from B, which the engine holds, in one tensor: only it is handed over.
    node.load(tiny.number["B-norm"])
    assert node.handed == ["model.norm.weight"]
    assert outputs(node) == fresh["B-norm"] != fresh["B"]
    assert all(tiny.registry.leases(v) == [] for n, v in tiny.number.items() if n != "B-norm")


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        (
            "B-fused",
            r"WeightsError: version \d+ is laid out for vLLM \(vllm-fused, tp=1\); SGLang loads "
            r"whole HF tensors: publish with --layout hf$",
        ),
        ("other-model", r"WeightsError: version \d+ is a different model"),
        ("B-corrupt", r"WeightsError: .*model-00001-of-00001\.safetensors: .*do not match"),
        (
            "B-fp8",
            r"WeightsError: version \d+ is quantized \(fp8\); weightcast's SGLang node loads "
            r"bf16 versions only: publish without --quantize$",
        ),
    ],
)
def test_a_refused_version_touches_nothing(
    node: SglangNode, tiny: Versions, fresh: dict[str, Any], name: str, reason: str
) -> None:
    node.load(tiny.number["C"])
    with pytest.raises(VersionRefused, match=f"{REFUSED}: {reason}"):
        node.load(tiny.number[name])
    assert outputs(node) == fresh["C"]  # still C, exactly
    assert node.engine.weight_version() == str(tiny.number["C"])
    said = report(tiny.registry, "sg-0")
    assert said.version == tiny.number["C"] and said.error.startswith(
        f"v{tiny.number[name]} not loaded: "
    )
    assert tiny.registry.leases(tiny.number[name]) == []
    node.load(tiny.number["B"])  # and the next version loads
    assert outputs(node) == fresh["B"]
    assert report(tiny.registry, "sg-0").error == ""


def test_the_sgl_kernel_stand_in_was_never_called() -> None:
    import sgl_kernel

    assert sgl_kernel.__version__.endswith("weightcast-stand-in")  # SGLang imported this one
    assert stand_in_calls() == ""
