"""The shard spec as a type: what the manifest records, what a parse refuses, and rank
slices that never reach past their tensor."""

from __future__ import annotations

import re

import pytest

from weightcast.contract.errors import LayoutError
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.sharding import RankSlice, Shard, ShardKind, rank_slice

from helpers.models import shape_of

QKV = {"kind": "qkv", "dim": 0, "tp": 2, "rank_rows": 8, "q_rows": 4, "kv_rows": 2}
EXPERTS = {"kind": "experts", "dim": 0, "tp": 4, "rank_rows": 2, "ep": 4, "experts": 2}

SHARDS = [
    Shard.qkv(2, 4, 2),
    Shard.gate_up(4, 16),
    Shard.expert_block(4, 4, 2),
    Shard.expert_block(2, 1, 8),
    Shard(ShardKind.VOCAB_PARALLEL),
    Shard(ShardKind.ROW_PARALLEL),
    Shard.row_parallel_ranks(2, 4),
    Shard(ShardKind.REPLICATED),
    Shard(ShardKind.HF),
]


@pytest.mark.parametrize("shard", SHARDS, ids=lambda s: str(s.kind))
def test_a_shard_spec_reads_back_what_it_records(shard: Shard) -> None:
    assert Shard.from_json(shard.as_json()) == shard


def test_the_recorded_spec_is_the_manifest_format_older_readers_know() -> None:
    assert Shard.qkv(2, 4, 2).as_json() == QKV
    assert Shard.gate_up(4, 16).as_json() == {
        "kind": "gate_up",
        "dim": 0,
        "tp": 4,
        "rank_rows": 32,
        "gate_rows": 16,
    }
    assert Shard(ShardKind.ROW_PARALLEL).as_json() == {"kind": "row_parallel", "dim": 1}
    assert Shard.row_parallel_ranks(8, 16).as_json() == {
        "kind": "row_parallel_ranks",
        "dim": 0,
        "tp": 8,
        "rank_rows": 16,
        "out_rows": 16,
    }
    assert Shard.expert_block(4, 4, 2).as_json() == EXPERTS
    assert Shard(ShardKind.REPLICATED).as_json() == {"kind": "replicated"}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([QKV], "], not an object"),
        ({**QKV, "kind": ["qkv"]}, "kind ['qkv'] is not one of qkv, gate_up"),
        ({"kind": "sliced"}, "kind 'sliced' is not one of"),
        ({**QKV, "gate_rows": 4}, "has fields a qkv shard does not: ['gate_rows']"),
        ({"kind": "replicated", "dim": 0}, "has fields a replicated shard does not: ['dim']"),
        ({**QKV, "dim": 1}, "dim 1: a qkv shard splits dim 0"),
        ({**QKV, "dim": False}, "dim False: a qkv shard splits dim 0"),
        ({**QKV, "tp": 2.0}, "tp 2.0 is not a positive integer"),
        ({**QKV, "q_rows": True}, "q_rows True is not a positive integer"),
        ({**QKV, "kv_rows": -2}, "kv_rows -2 is not a positive integer"),
        ({**QKV, "rank_rows": 4096}, "rank_rows 4096 is not the sum of its parts"),
        ({k: v for k, v in QKV.items() if k != "kv_rows"}, "kv_rows None is not a positive"),
        ({**EXPERTS, "ep": 2}, "ep 2 with tp=4: vLLM's expert parallelism spans every rank"),
        ({**EXPERTS, "ep": 0}, "ep 0 is not a positive integer"),
        ({**EXPERTS, "experts": 3}, "rank_rows 2 is not the sum of its parts"),
        ({**EXPERTS, "gate_rows": 2}, "has fields a experts shard does not: ['gate_rows']"),
        ({k: v for k, v in EXPERTS.items() if k != "ep"}, "ep None is not a positive integer"),
    ],
)
def test_a_malformed_shard_spec_is_refused_naming_the_field(raw: object, message: str) -> None:
    with pytest.raises(LayoutError, match=re.escape(message)):
        Shard.from_json(raw)


@pytest.mark.parametrize(
    ("shard", "shape", "whole", "message"),
    [
        (Shard.qkv(2, 4, 2), [16], True, None),
        (Shard.qkv(2, 4, 2), [4096], True, "2 ranks of 8 rows do not make 4096 rows"),
        (Shard.qkv(2, 4, 2), [8, 3], False, None),
        (Shard.qkv(2, 4, 2), [16, 3], False, "a rank's part of 8 rows for tp=2"),
        (Shard.qkv(4, 4, 2), [32], True, "fused for tp=4 cannot serve tp=2"),
        (Shard.gate_up(2, 3), [], True, "a gate_up tensor of shape [] has no dim 0"),
        (Shard(ShardKind.ROW_PARALLEL), [4], True, "has no dim 1"),
        (Shard(ShardKind.ROW_PARALLEL), [4, 4, 4], False, "is a matrix, not [4, 4, 4]"),
        (Shard(ShardKind.ROW_PARALLEL), [4, 3], True, "tp=2 does not divide the 3 input columns"),
        (Shard.row_parallel_ranks(2, 4), [8, 3], True, None),
        (Shard.row_parallel_ranks(2, 4), [4, 3], False, None),
        (Shard.row_parallel_ranks(2, 4), [4, 3], True, "2 ranks of 4 rows do not make 4 rows"),
        (Shard.row_parallel_ranks(2, 4), [8, 3], False, "a rank's part of 4 rows for tp=2"),
        (Shard.row_parallel_ranks(2, 4), [8], True, "is a matrix, not [8]"),
        (Shard(ShardKind.VOCAB_PARALLEL), [], True, "has no dim 0"),
        (Shard(ShardKind.REPLICATED), [], True, None),
        (Shard(ShardKind.HF), [7], True, None),
        (Shard.expert_block(2, 2, 4), [8, 6, 4], True, None),
        (Shard.expert_block(2, 2, 4), [4, 6, 4], False, None),
        (Shard.expert_block(2, 2, 4), [9, 6, 4], True, "2 ranks of 4 rows do not make 9 rows"),
        (Shard.expert_block(2, 2, 4), [8, 24], True, "has 3 dimensions, not [8, 24]"),
        (Shard.expert_block(2, 2, 4), [8, 6, 4], False, "a rank's part of 4 rows for tp=2"),
        (Shard.expert_block(4, 1, 4), [16, 6, 4], True, "fused for tp=4 cannot serve tp=2"),
    ],
)
def test_a_shard_spec_must_fit_its_tensor(
    shard: Shard, shape: list[int], whole: bool, message: str | None
) -> None:
    if message is None:
        shard.check(shape, 2, whole)
        return
    with pytest.raises(LayoutError, match=re.escape(message)):
        shard.check(shape, 2, whole)


def test_no_rank_slice_reaches_past_its_tensor() -> None:
    assert rank_slice(Shard.qkv(2, 4, 2), [16, 3], 1, 2) == RankSlice(0, 8, 16)
    assert rank_slice(Shard.row_parallel_ranks(4, 3), [12, 5], 2, 4) == RankSlice(0, 6, 9)
    with pytest.raises(LayoutError, match="do not make 128 rows"):
        rank_slice(Shard.qkv(1, 4092, 2), [128], 0, 1)  # the norm sharded as qkv of 4096
    with pytest.raises(LayoutError, match="a hf tensor has no rank slices"):
        rank_slice(Shard(ShardKind.HF), [4], 0, 1)
    assert rank_slice(Shard.expert_block(2, 2, 4), [8, 6, 4], 1, 2) == RankSlice(0, 4, 8)


def test_a_shard_has_exactly_the_fields_of_its_kind() -> None:
    with pytest.raises(LayoutError, match="a qkv shard needs kv_rows"):
        Shard(ShardKind.QKV, tp=2, q_rows=4)
    with pytest.raises(LayoutError, match="a replicated shard has no tp"):
        Shard(ShardKind.REPLICATED, tp=2)
    with pytest.raises(LayoutError, match="experts shard needs experts"):
        Shard(ShardKind.EXPERTS, tp=2, ep=2)
    with pytest.raises(LayoutError, match="a gate_up shard has no ep"):
        Shard(ShardKind.GATE_UP, tp=2, gate_rows=2, ep=2)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_hidden_layers", 2.5, "config.json: num_hidden_layers is 2.5, not a positive integer"),
        ("hidden_size", "16", "config.json: hidden_size is '16', not a positive integer"),
        ("vocab_size", True, "config.json: vocab_size is True, not a positive integer"),
        ("num_attention_heads", -4, "num_attention_heads is -4, not a positive integer"),
        ("head_dim", [8], "config.json: head_dim is [8], not a positive integer"),
        ("tie_word_embeddings", "yes", "tie_word_embeddings is 'yes', not true or false"),
        ("intermediate_size", None, "config.json lacks 'intermediate_size'"),
    ],
)
def test_config_numbers_are_positive_integers_and_flags_booleans(
    field: str, value: object, message: str
) -> None:
    config = {**shape_of(4, 2, 8, hidden=16).to_hf_config(), field: value}
    with pytest.raises(LayoutError, match=re.escape(message)):
        ModelShape.from_hf_config(config)


def test_config_defaults_stand_in_for_null_heads_and_head_dim() -> None:
    shape = shape_of(4, 2, 8, hidden=32)
    config = {**shape.to_hf_config(), "num_key_value_heads": None, "head_dim": None}
    read = ModelShape.from_hf_config(config)
    assert (read.num_kv_heads, read.head_dim) == (4, 8)
    assert ModelShape.from_hf_config(shape.to_hf_config()) == shape
