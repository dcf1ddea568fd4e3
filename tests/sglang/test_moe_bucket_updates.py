"""A real CPU ``sglang.Engine`` serving a Qwen3-MoE, kept on versions by an
:class:`SglangNode` that reads them from a bucket of a real S3 server (SeaweedFS): each
version equals, exactly, a fresh SGLang engine started from the same version, read whole and
then by delta (ranged GETs of the delta's frames, verified).

Every layer is sparse and the embeddings are untied: SGLang 0.5.23 on this CPU, a stock engine
started from the ``save_pretrained`` directory with no weightcast involved, computes NaN for a
Qwen3-MoE with a dense layer among sparse ones (``mlp_only_layers``) and uniform
log-probabilities (-ln 1000 for every token) for one with tied embeddings; without either its
outputs are transformers' within bf16 error."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from weightcast.client.sglang.engine import SglangNode
from weightcast.client.sglang.local_engine import LocalSglangEngine
from weightcast.client.weights import WeightsClient
from weightcast.contract.model_shape import ModelShape
from weightcast.local.s3_server import S3Server
from weightcast.store.s3 import S3Location, S3Store

from helpers.models import moe_checkpoint
from helpers.registry import Registry
from helpers.s3 import unique_bucket
from sglang_helpers import greedy, sglang_engine


@pytest.fixture(scope="module")
def moe(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoints A, B, C (``save_pretrained``, different weights) published in the ``hf``
    layout (C's delta is from B)."""
    root = tmp_path_factory.mktemp("moe")
    dirs = {
        name: moe_checkpoint(root / name, seed=seed, dense_layers=(), tied=False)
        for seed, name in enumerate("ABC")
    }
    config = json.loads((dirs["A"] / "config.json").read_text())
    states = {n: load_file(str(d / "model.safetensors")) for n, d in dirs.items()}
    number = {n: registry.publish(config, states[n], layout="hf") for n in "ABC"}
    return {"config": config, "number": number}


@pytest.fixture(scope="module")
def fresh(moe: dict[str, Any], registry: Registry, fresh_outputs: Any) -> dict[str, Any]:
    paths = {n: registry.versions[moe["number"][n]] for n in "BC"}
    by_dir = fresh_outputs(list(paths.values()))
    return {n: by_dir[p] for n, p in paths.items()}


@pytest.fixture(scope="module")
def node(
    moe: dict[str, Any], registry: Registry, s3_server: S3Server, fresh: dict[str, Any]
) -> Iterator[SglangNode]:
    """An engine started from A's directory, whose node reads a bucket holding the versions
    (uploaded as the publisher uploads them)."""
    bucket = unique_bucket()
    s3_server.create_bucket(bucket)
    url = f"s3://{bucket}/run?endpoint_url={s3_server.endpoint_url}&addressing_style=path"
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.client_env().items():
            env.setenv(name, value)
        store = S3Store(S3Location.parse(url))
        for version in moe["number"].values():
            path: Path = registry.versions[version]
            store.upload_version(path.name, path)
        store.close()
        client = WeightsClient(
            registry.redis_url, url, namespace=registry.namespace, node_id="sg-moe", keep_base=True
        )
        with sglang_engine(registry.versions[moe["number"]["A"]]) as engine:
            node = SglangNode(
                LocalSglangEngine(engine), client, ModelShape.from_hf_config(moe["config"])
            )
            yield node
            node.close()
        client.close()


def test_a_moe_engine_on_a_bucket_equals_fresh_engines(
    node: SglangNode, moe: dict[str, Any], fresh: dict[str, Any]
) -> None:
    assert fresh["B"] != fresh["C"]
    # SGLang computes these versions (NaN or uniform log-probabilities would tie everything)
    assert all(math.isfinite(x) for out in fresh["B"] for x in out["logprobs"])
    assert len({x for out in fresh["B"] for x in out["logprobs"]}) > 1
    for name, via in (("B", "full"), ("C", "delta")):
        staged = node.load(moe["number"][name])
        assert staged.via == via, name
        assert greedy(node.engine.engine) == fresh[name], name  # type: ignore[attr-defined]
        assert node.engine.weight_version() == str(moe["number"][name])
