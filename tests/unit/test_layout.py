"""The vllm-fused layout against an independent model of vLLM's per-rank placement."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from weightcast.contract.errors import LayoutError
from weightcast.contract.fusion import assemble, check_tp, plan_vllm_fused, unfuse
from weightcast.contract.layout import FUSED_WEIGHTS_FILE, fused_config
from weightcast.contract.manifest import Manifest, verify_files
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.sharding import RankSlice, Shard, ShardKind, rank_slice
from weightcast.contract.snapshot_format import SnapshotInfo
from weightcast_publisher.converter import ConvertOptions, convert
from weightcast_publisher.snapshot_scan import Snapshot

from helpers.models import hf_state, rank_part, shape_of
from helpers.snapshots import write_snapshot
from vllm_reference import (
    merged_column_parallel_rank,
    qkv_parallel_rank,
    row_parallel_rank,
    vocab_parallel_rank,
)


def fuse(state: dict[str, torch.Tensor], shape: ModelShape, tp: int) -> dict[str, torch.Tensor]:
    plan = plan_vllm_fused({k: t.shape[0] for k, t in state.items()}, shape, tp)
    return {p.name: assemble(p, state) for p in plan}


def assert_matches_vllm(
    fused: dict[str, torch.Tensor], state: dict[str, torch.Tensor], shape: ModelShape, tp: int
) -> None:
    for i in range(shape.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        kinds = ["weight"] + (["bias"] if shape.attention_bias else [])
        for kind in kinds:
            qkv = fused[f"{attn}.qkv_proj.{kind}"]
            blocks = qkv.chunk(tp)
            for rank in range(tp):
                expected = qkv_parallel_rank(
                    state[f"{attn}.q_proj.{kind}"],
                    state[f"{attn}.k_proj.{kind}"],
                    state[f"{attn}.v_proj.{kind}"],
                    shape.num_heads,
                    shape.num_kv_heads,
                    shape.head_dim,
                    tp,
                    rank,
                )
                assert torch.equal(blocks[rank], expected), f"{attn} {kind} rank {rank}"
        gate_up = fused[f"{mlp}.gate_up_proj.weight"].chunk(tp)
        for rank in range(tp):
            expected = merged_column_parallel_rank(
                state[f"{mlp}.gate_proj.weight"], state[f"{mlp}.up_proj.weight"], tp, rank
            )
            assert torch.equal(gate_up[rank], expected), f"{mlp} rank {rank}"


# (heads, kv heads, head_dim): tiny, Qwen3-0.6B/1.7B, Qwen3-4B/8B head counts.
SHAPES = {"tiny": (4, 2, 64), "0.6B": (16, 8, 128), "8B": (32, 8, 128)}
CASES = (
    [("tiny", tp) for tp in (1, 2, 4)]
    + [("0.6B", tp) for tp in (1, 2, 4, 8, 16)]
    + [("8B", tp) for tp in (1, 4, 8, 16, 32)]
)


@pytest.mark.parametrize(("model", "tp"), CASES)
def test_each_rank_block_is_what_vllm_places_on_that_rank(model: str, tp: int) -> None:
    heads, kv, head_dim = SHAPES[model]
    shape = shape_of(heads, kv, head_dim // 16, bias=True)  # real head counts, small tensors
    state = hf_state(shape)
    fused = fuse(state, shape, tp)
    assert_matches_vllm(fused, state, shape, tp)
    rows = fused["model.layers.0.self_attn.qkv_proj.weight"].shape[0]
    expected_rows = shape.q_rows + 2 * max(tp, kv) * shape.head_dim
    assert rows == expected_rows  # kv heads replicated when tp > kv heads
    assert "lm_head.weight" not in fused  # tied: written once, as embed_tokens


@pytest.mark.parametrize(("model", "tp"), CASES)
def test_rank_slice_of_every_tensor_is_what_vllm_loads_on_that_rank(model: str, tp: int) -> None:
    heads, kv, head_dim = SHAPES[model]
    shape = shape_of(heads, kv, head_dim // 16, tied=False, bias=True)
    state = hf_state(shape)
    plan = plan_vllm_fused({k: t.shape[0] for k, t in state.items()}, shape, tp)
    fused = {p.name: assemble(p, state) for p in plan}
    for rank in range(tp):
        for p in plan:
            tensor = fused[p.name]
            mine = rank_part(tensor, p.shard, rank, tp)
            kind = p.shard.kind
            if kind in ("qkv", "gate_up"):
                expected = tensor.chunk(tp)[rank]  # checked against vLLM's loaders above
            elif kind == "vocab_parallel":
                loaded = vocab_parallel_rank(tensor, tp, rank)
                expected = loaded[: mine.shape[0]]
                assert not loaded[mine.shape[0] :].any(), "rows past the vocabulary are padding"
            elif kind == "row_parallel_ranks":  # vLLM's loader on the HF tensor
                expected = row_parallel_rank(state[p.name], tp, rank)
            else:
                expected = tensor
            assert torch.equal(mine, expected), f"{p.name} rank {rank}"


def test_rank_slice_refuses_a_tp_the_tensor_was_not_fused_for() -> None:
    shard = Shard.from_json(
        {"kind": "qkv", "dim": 0, "tp": 2, "rank_rows": 8, "q_rows": 4, "kv_rows": 2}
    )
    with pytest.raises(LayoutError, match="fused for tp=2 cannot serve tp=4"):
        rank_slice(shard, [16, 8], 0, 4)
    with pytest.raises(LayoutError, match="outside tp=2"):
        rank_slice(shard, [16, 8], 2, 2)


def test_vocab_slices_skip_padding_rows() -> None:
    # 1000 tokens pad to 1024; at tp=8 each rank holds 128 rows, the last only 1000 - 896.
    spec = Shard(ShardKind.VOCAB_PARALLEL)
    assert rank_slice(spec, [1000, 4], 7, 8) == RankSlice(0, 896, 1000)
    assert rank_slice(spec, [1000, 4], 0, 8) == RankSlice(0, 0, 128)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_unfuse_recovers_the_hf_tensors(tp: int) -> None:
    shape = shape_of(16, 8, 4, tied=False, bias=True)
    state = hf_state(shape)
    recovered = unfuse(fuse(state, shape, tp), shape, tp)
    assert recovered.keys() == state.keys()
    assert all(torch.equal(recovered[k], state[k]) for k in state)
    older = fuse(state, shape, tp)  # format 1 or 2: row-parallel tensors stored as in HF
    older |= {k: v for k, v in state.items() if k.endswith(("o_proj.weight", "down_proj.weight"))}
    recovered = unfuse(older, shape, tp)
    assert all(torch.equal(recovered[k], state[k]) for k in state)


def test_unfuse_refuses_disagreeing_replicas_and_a_wrong_tp() -> None:
    shape = shape_of(16, 8, 4)
    fused = fuse(hf_state(shape), shape, 16)  # each kv head held by two ranks
    with pytest.raises(LayoutError, match="tp=8 implies"):
        unfuse(fused, shape, 8)
    qkv = fused["model.layers.0.self_attn.qkv_proj.weight"]
    qkv[(qkv.shape[0] // 16) - 1] += 1  # rank 0's v head differs from rank 1's copy
    with pytest.raises(
        LayoutError, match=re.escape("replicas of model.layers.0.self_attn.v_proj.weight")
    ):
        unfuse(fused, shape, 16)


def test_head_dim_comes_from_the_config_not_hidden_over_heads() -> None:
    config = {
        "num_hidden_layers": 28,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
    shape = ModelShape.from_hf_config(config)
    assert shape.head_dim == 128 and shape.q_rows == 2048  # not 1024 // 16 = 64


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "message"),
    [
        (16, 8, 3, "does not divide the 16 attention heads"),
        (16, 8, 32, "does not divide the 16 attention heads"),
        (24, 8, 6, "one must divide the other"),
        (16, 8, 0, "tp must be >= 1"),
    ],
)
def test_tp_that_vllm_refuses_is_refused(heads: int, kv: int, tp: int, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        check_tp(shape_of(heads, kv, 4, inter=48), tp)


def test_missing_or_misshapen_tensors_are_reported_by_name() -> None:
    shape = shape_of(4, 2, 8)
    state = hf_state(shape)
    rows = {k: t.shape[0] for k, t in state.items()}
    del rows["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(LayoutError, match=re.escape("layers.1.self_attn.v_proj.weight is missing")):
        plan_vllm_fused(rows, shape, 2)
    rows = {k: t.shape[0] for k, t in state.items()}
    rows["model.layers.0.mlp.up_proj.weight"] = 7
    with pytest.raises(
        LayoutError, match=re.escape("up_proj.weight has 7 rows; the config implies 32")
    ):
        plan_vllm_fused(rows, shape, 2)


def test_manifest_shard_specs_say_how_vllm_splits_each_tensor() -> None:
    shape = shape_of(16, 8, 4, tied=False)
    plan = {
        p.name: p.shard.as_json()
        for p in plan_vllm_fused({k: t.shape[0] for k, t in hf_state(shape).items()}, shape, 16)
    }
    assert plan["model.layers.0.self_attn.qkv_proj.weight"] == {
        "kind": "qkv",
        "dim": 0,
        "tp": 16,
        "rank_rows": 4 + 2 * 4,
        "q_rows": 4,
        "kv_rows": 4,
    }
    assert plan["model.layers.0.mlp.gate_up_proj.weight"]["rank_rows"] == 4
    assert plan["model.layers.0.self_attn.o_proj.weight"] == {
        "kind": "row_parallel_ranks",
        "dim": 0,
        "tp": 16,
        "rank_rows": shape.hidden_size,
        "out_rows": shape.hidden_size,
    }
    assert plan["lm_head.weight"]["kind"] == "vocab_parallel"
    assert plan["model.layers.0.self_attn.q_norm.weight"] == {"kind": "replicated"}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_publisher_conversion_of_a_real_dcp_snapshot(tmp_path: Path, tp: int) -> None:
    """Through DCP files and safetensors: the published file matches vLLM's placement."""
    shape = shape_of(4, 2, 16, hidden=32, inter=64, tied=True)
    state = hf_state(shape, torch.bfloat16)
    snapshot_dir = write_snapshot(tmp_path, 5, shape, state)
    snapshot = Snapshot(snapshot_dir, SnapshotInfo.read(snapshot_dir))

    published = convert(snapshot, tmp_path / "weights", 7, ConvertOptions(tp=tp))

    assert published.path == tmp_path / "weights" / "v7"
    manifest = Manifest.read(published.path)
    verify_files(published.path, manifest)
    assert (manifest.version, manifest.step, manifest.tp, manifest.dtype) == (7, 5, tp, "bfloat16")
    fused = load_file(str(published.path / FUSED_WEIGHTS_FILE))
    assert {t.name for t in manifest.tensors} == set(fused)
    assert_matches_vllm(fused, state, shape, tp)
    # The fused layout's config.json names an architecture stock vLLM refuses.
    assert json.loads((published.path / "config.json").read_text()) == fused_config(
        shape.to_hf_config()
    )
