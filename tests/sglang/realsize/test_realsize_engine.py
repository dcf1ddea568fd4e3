"""A CPU ``sglang.Engine`` of Qwen3-0.6B's shape (1.19 GB in bf16) kept by an
:class:`SglangNode` on versions of the real publisher, over eight updates: read whole, by
delta, back to an older version, by delta from it, a corrupt version refused (its delta and
its file each fail a digest), whole after the refusal, back again, and by a chain of two
deltas. Every update hands 1.19 GB to SGLang. The engine started from version 1 generates
what a fresh engine of it does, by construction; after every update it generates exactly
what it generated for that version before, whichever way it was read, and version 1, read
whole after the others, exactly what it generated at the start.

Each version moves 3% of the values of the one before by one ulp, as an RL step does
(``helpers.realsize``); the publisher keeps every delta (``delta_behind = wait``: two loaded
cores encode a 0.6B delta slower than they write it).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator

import pytest

from weightcast.client.engine import REFUSED, VersionRefused
from weightcast.client.sglang.engine import SglangNode
from weightcast.client.sglang.local_engine import LocalSglangEngine
from weightcast.contract.model_shape import ConfigExtras, ModelShape, hf_tensor_shapes
from weightcast.local.redis_server import RedisServer

from helpers.models import drift, plausible_state
from helpers.realsize import MOVED_EVERY, SHAPE, corrupt_version
from helpers.registry import Registry
from sglang_helpers import greedy, sglang_engine

pytestmark = pytest.mark.realsize

CONFIG = SHAPE.to_hf_config(extras=ConfigExtras(max_position_embeddings=4096))
MEMORY_FRACTION = 0.2
"""SGLang's ``mem_fraction_static`` at this shape: the weights leave room for a KV cache."""
NBYTES = sum(math.prod(size) * 2 for size in hf_tensor_shapes(SHAPE).values())
"""A version's bytes: bf16, every tensor."""
CORRUPT = 4
WALK = (  # (version, how the node takes it)
    (2, "full"),  # no base held yet
    (3, "delta"),
    (1, "full"),  # back to an older version: 1 has no delta
    (2, "delta"),  # from 1
    (CORRUPT, REFUSED),  # the chain 3, 4 fails at 4's frame; 4's file fails its digest
    (3, "full"),  # the refused full read let go of the base: the node holds none
    (1, "full"),
    (3, "chain"),  # the deltas of 2 and 3
)


@pytest.fixture(scope="module")
def versions(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Registry]:
    """Versions 1 to 4, each 3% of the values of the one before moved by one ulp, in the
    ``hf`` layout; version 4 corrupted in one changed block of its file and of its delta.
    Their 10 GB (snapshots and versions) are removed at the end: the real-size tier after
    this one needs the disk."""
    root = tmp_path_factory.mktemp("realsize")
    registry = Registry(redis_server.url, "sg-realsize", root, publisher={"delta_behind": "wait"})
    state = plausible_state(SHAPE, seed=1)
    try:
        for step in range(1, CORRUPT + 1):
            if step > 1:
                drift(state, step, MOVED_EVERY)
            assert registry.publish(CONFIG, state, layout="hf") == step
        corrupt_version(registry.versions[CORRUPT])
        yield registry
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def node(versions: Registry) -> Iterator[SglangNode]:
    client = versions.client("sg-realsize", keep_base=True)
    with sglang_engine(versions.versions[1], mem_fraction_static=MEMORY_FRACTION) as engine:
        node = SglangNode(LocalSglangEngine(engine), client, ModelShape.from_hf_config(CONFIG))
        yield node
        node.close()
    client.close()


def test_an_engine_walks_real_size_versions_and_generates_each_exactly(
    node: SglangNode, versions: Registry
) -> None:
    engine = node.engine.engine  # type: ignore[attr-defined]
    outputs = {1: greedy(engine)}  # the engine started from version 1: a fresh engine's
    served = 1
    for version, via in WALK:
        if via == REFUSED:
            with pytest.raises(VersionRefused, match=REFUSED):
                node.load(version)
        else:
            staged = node.load(version)
            assert staged.via == via, (version, node.client.reader.stats)
            assert staged.nbytes == NBYTES, version
            served = version
        assert node.engine.weight_version() == str(served)
        generated = greedy(engine)
        assert outputs.setdefault(served, generated) == generated, (version, via)
    assert len({repr(o) for o in outputs.values()}) == len(outputs) == 3  # the versions differ
    assert versions.leases(served) == ["sg-realsize"]
