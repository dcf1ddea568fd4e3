"""FP8 versions (``publisher.quantize fp8``) through the real converter, against references
independent of weightcast: every HF weight quantized from the format's definition
(``vllm_reference.fp8_block_quantize``), then placed per rank as vLLM's loaders place a weight
and, block for block, its ``BlockQuantScaleParameter`` (``vllm_reference``'s rank functions,
with head and partition sizes counted in 128-blocks for the scales). What a node reads of each
rank (``VersionReader.rank_tensors``: one fused file, or per-rank files) must be those bytes,
dense at tp 1, 2 and 4 (kv heads replicated at 4) and Qwen3-MoE at tp 2 and ep 2; the ``hf``
layout is the FP8 checkpoint itself. A NaN is never published; a tp that cuts a scale block
is refused as a setting. Through the daemon, FP8 versions are leased, verified and evicted as
bf16 ones (their deltas: test_delta_publish.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file

from weightcast.client.reader import VersionReader
from weightcast.contract.errors import BlockCutError
from weightcast.contract.fp8 import QUANTIZATION_CONFIG
from weightcast.contract.keys import Keys
from weightcast.contract.layout import LAYOUT_HF
from weightcast.contract.manifest import MANIFEST_NAME, Manifest, sha256_bytes, verify_files
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.snapshot_format import (
    FORMAT_DCP_SAFETENSORS,
    FORMAT_DCP_TORCH_SAVE,
    read_complete,
)
from weightcast.contract.version_info import VersionInfo
from weightcast.local.redis_server import RedisServer
from weightcast_publisher.converter import ConvertedVersion, ConvertOptions, convert
from weightcast_publisher.snapshot_scan import CorruptSnapshot, Snapshot

from helpers.models import hf_state, moe_shape, shape_of
from helpers.snapshots import write_snapshot
from helpers.versions import Deployment
from vllm_reference import (
    fp8_block_quantize,
    fused_moe_rank,
    merged_column_parallel_rank,
    qkv_parallel_rank,
    row_parallel_rank,
    vocab_parallel_rank,
)

DENSE = dataclasses.replace(shape_of(4, 2, 128, hidden=256, inter=512, tied=False), vocab_size=1000)
"""Every tp-split dimension whole 128-blocks up to tp 4; 2 kv heads, replicated at tp 4."""
MOE = dataclasses.replace(
    moe_shape(experts=4, moe_inter=256, layers=2),
    hidden_size=256,
    num_heads=2,
    num_kv_heads=2,
    head_dim=128,
    intermediate_size=256,
    vocab_size=1000,
)
EXPERTS = "mlp.experts.routed_experts"


def publish(
    tmp_path: Path, shape: ModelShape, state: dict, format: str = FORMAT_DCP_SAFETENSORS, **options
) -> ConvertedVersion:
    snapshot = write_snapshot(tmp_path / "checkpoints", 1, shape, state, format)
    options = {"quantize": "fp8", **options}
    published = convert(
        Snapshot(snapshot, read_complete(snapshot)),
        tmp_path / "weights",
        1,
        ConvertOptions(**options),
    )
    verify_files(published.path, Manifest.read(published.path))
    return published


def info(published: ConvertedVersion) -> VersionInfo:
    text = (published.path / MANIFEST_NAME).read_bytes()
    m = published.manifest
    return VersionInfo(
        version=m.version, path=published.path.name, step=m.step, layout=m.layout, tp=m.tp,
        dtype=m.dtype, bytes=m.total_bytes, manifest_sha256=sha256_bytes(text),
        run_id=m.run_id, created_at=time.time(),
    )  # fmt: skip


def quantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint of ``state`` by the reference: ``X.weight`` as FP8 and
    ``X.weight_scale_inv`` for every linear weight, the rest as it is."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("_proj.weight"):
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = fp8_block_quantize(tensor)
        else:
            out[name] = tensor
    return out


def expected_rank(
    ref: dict[str, torch.Tensor], shape: ModelShape, tp: int, rank: int, ep: bool = False
) -> dict[str, torch.Tensor]:
    """What vLLM's loaders place on ``rank`` from the reference FP8 checkpoint: weights as
    ``weight_loader`` places them, scales the same in block units (``BlockQuantScaleParameter``)."""
    out: dict[str, torch.Tensor] = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight")[
        : 1 + (not shape.tie_word_embeddings)
    ]:
        out[name] = vocab_parallel_rank(ref[name], tp, rank)
    out["model.norm.weight"] = ref["model.norm.weight"]
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = ref[f"{p}.{norm}.weight"]
        for norm in ("q_norm", "k_norm"):
            out[f"{p}.self_attn.{norm}.weight"] = ref[f"{p}.self_attn.{norm}.weight"]
        for suffix, head in (
            ("weight", shape.head_dim),
            ("weight_scale_inv", shape.head_dim // 128),
        ):
            q, k, v = (ref[f"{p}.self_attn.{x}_proj.{suffix}"] for x in "qkv")
            out[f"{p}.self_attn.qkv_proj.{suffix}"] = qkv_parallel_rank(
                q, k, v, shape.num_heads, shape.num_kv_heads, head, tp, rank
            )
            out[f"{p}.self_attn.o_proj.{suffix}"] = row_parallel_rank(
                ref[f"{p}.self_attn.o_proj.{suffix}"], tp, rank
            )
            if shape.sparse(layer):
                e = range(shape.num_experts)
                gates, ups, downs = (
                    [ref[f"{p}.mlp.experts.{i}.{x}_proj.{suffix}"] for i in e]
                    for x in ("gate", "up", "down")
                )
                w13, w2 = fused_moe_rank(gates, ups, downs, tp, rank, ep)
                out[f"{p}.{EXPERTS}.w13_{suffix}"], out[f"{p}.{EXPERTS}.w2_{suffix}"] = w13, w2
            else:
                gate, up = (ref[f"{p}.mlp.{x}_proj.{suffix}"] for x in ("gate", "up"))
                out[f"{p}.mlp.gate_up_proj.{suffix}"] = merged_column_parallel_rank(
                    gate, up, tp, rank
                )
                out[f"{p}.mlp.down_proj.{suffix}"] = row_parallel_rank(
                    ref[f"{p}.mlp.down_proj.{suffix}"], tp, rank
                )
        if shape.sparse(layer):
            out[f"{p}.mlp.gate.weight"] = ref[f"{p}.mlp.gate.weight"]
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        expected = want[name][: tensor.shape[0]]  # a vocab rank's padding rows are not stored
        assert tensor.dtype == expected.dtype, name
        assert torch.equal(bits(tensor), bits(expected)), name


CASES = {
    "dense tp 1": (DENSE, {"tp": 1}),
    "dense tp 2": (DENSE, {"tp": 2}),
    "dense tp 2, per-rank files": (DENSE, {"tp": 2, "per_rank_files": True}),
    "dense tp 4 (kv heads replicated), per-rank files": (
        DENSE,
        {"tp": 4, "per_rank_files": True},
    ),
    "dense tp 2, read with dcp.load": (DENSE, {"tp": 2, "reader": "dcp-load"}),
    "moe tp 2": (MOE, {"tp": 2}),
    "moe ep 2, per-rank files": (MOE, {"tp": 2, "expert_parallel": True, "per_rank_files": True}),
}


@pytest.mark.parametrize(("shape", "options"), CASES.values(), ids=CASES.keys())
def test_each_rank_reads_what_vllm_loads_from_an_independent_fp8_checkpoint(
    tmp_path: Path, shape: ModelShape, options: dict
) -> None:
    state = hf_state(shape, torch.bfloat16)
    ref = quantized(state)
    published = publish(tmp_path, shape, state, **options)
    assert published.manifest.dtype == "mixed"
    config = json.loads((published.path / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    tp = options["tp"]
    ep = tp if options.get("expert_parallel") else 1
    reader = VersionReader(tmp_path / "weights")
    for rank in range(tp):
        got = reader.rank_tensors(info(published), rank, tp, ep)
        assert_bitwise(got, expected_rank(ref, shape, tp, rank, ep > 1))


def test_the_hf_layout_is_the_fp8_checkpoint_itself(tmp_path: Path) -> None:
    state = hf_state(DENSE, torch.bfloat16)
    published = publish(tmp_path, DENSE, state, layout=LAYOUT_HF)
    files = sorted(published.path.glob("*.safetensors"))
    written = {k: v for f in files for k, v in load_file(f).items()}
    want = quantized(state)
    assert sorted(written) == sorted(want)
    for name, tensor in written.items():
        assert tensor.dtype == want[name].dtype and torch.equal(bits(tensor), bits(want[name]))
    config = json.loads((published.path / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG
    assert config["architectures"] == ["Qwen3ForCausalLM"]


def test_a_nan_is_never_published_as_fp8(tmp_path: Path) -> None:
    """A snapshot the trainer's own writer would have refused (an older trainer's format)."""
    state = hf_state(DENSE, torch.bfloat16)
    state["model.layers.1.mlp.down_proj.weight"][5, 300] = float("nan")
    with pytest.raises(CorruptSnapshot, match=r"non-finite .*down_proj\.weight_scale_inv"):
        publish(tmp_path, DENSE, state, FORMAT_DCP_TORCH_SAVE, tp=2)
    assert not list((tmp_path / "weights").iterdir())


def test_a_tp_that_cuts_a_scale_block_is_a_setting_refused_naming_the_tensor(
    tmp_path: Path,
) -> None:
    shape = dataclasses.replace(DENSE, intermediate_size=384)  # 192 rows per rank at tp 2
    state = hf_state(shape, torch.bfloat16)
    with pytest.raises(BlockCutError, match=r"^model\.layers\.0\.mlp\.down_proj\.weight: "):
        publish(tmp_path, shape, state, tp=2)
    publish(tmp_path, shape, state, tp=1)  # whole blocks at tp 1


def test_fp8_versions_are_leased_verified_and_evicted_as_bf16_ones(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Through the publisher daemon (``publisher.quantize fp8``, keep 1, no delta window): a
    leased FP8 version outlives newer ones and reads verified, per rank; released, it is
    evicted."""
    deployment = Deployment(
        client,
        keys,
        tmp_path,
        redis_server.url,
        tp=2,
        shape=DENSE,
        quantize="fp8",
        keep=1,
        delta_window=0,
    )
    deployment.publish()
    reader = deployment.reader()
    with reader.lease(1) as leased:
        deployment.publish()
        deployment.publish()
        assert deployment.registry.live_versions() == [1, 3]
        manifest = reader.verify(leased)
        assert {t.dtype for t in manifest.tensors} == {"float8_e4m3fn", "float32", "bfloat16"}
        parts = VersionReader(tmp_path / "weights").rank_tensors(leased, 1, 2)
        assert parts["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    deployment.evictor.run()
    assert deployment.registry.live_versions() == [3]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v3"]
