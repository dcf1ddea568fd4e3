"""A rank's part, handed to vLLM's loaders under HF names, lands where the loaders look.

``placement.hf_tensors`` turns one rank's part of a fused version into HF-named "virtual
whole" tensors. Fed to loaders that behave like vLLM's (``tests/vllm_reference.py``,
independent of weightcast's layout code), they must give that rank exactly what the same
loaders give it from the source HF tensors. (tests/vllm checks the same against vLLM itself.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weightcast.client.vllm.placement import hf_tensors, packed_name
from weightcast.client.vllm.staging import RankPart
from weightcast.contract.fusion import assemble, plan_vllm_fused
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.sharding import Shard, ShardKind

from helpers.models import hf_state, rank_part, shape_of
from vllm_reference import (
    merged_column_parallel_rank,
    qkv_parallel_rank,
    row_parallel_rank,
    vocab_parallel_rank,
)


def vllm_rank(state: dict[str, torch.Tensor], shape: ModelShape, tp: int, rank: int) -> dict:
    """What vLLM's loaders put on ``rank`` from HF tensors, by vLLM parameter name."""
    held = {}
    for name, tensor in state.items():
        if ".q_proj." in name:
            k, v = (state[name.replace(".q_proj.", f".{x}_proj.")] for x in "kv")
            held[packed_name(name)] = qkv_parallel_rank(
                tensor, k, v, shape.num_heads, shape.num_kv_heads, shape.head_dim, tp, rank
            )
        elif ".gate_proj." in name:
            up = state[name.replace(".gate_proj.", ".up_proj.")]
            held[packed_name(name)] = merged_column_parallel_rank(tensor, up, tp, rank)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            held[name] = vocab_parallel_rank(tensor, tp, rank)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            held[name] = row_parallel_rank(tensor, tp, rank)
        elif not any(f".{x}_proj." in name for x in ("k", "v", "up")):
            held[name] = tensor
    return held


CASES = [
    (shape_of(4, 2, 8, hidden=16, inter=32), tp)
    for tp in (1, 2, 4)  # tp 4 replicates kv
] + [
    (shape_of(4, 4, 8, hidden=16, inter=32, tied=False, bias=True), 2),
    (shape_of(8, 2, 4, hidden=16, inter=64), 8),
]


@pytest.mark.parametrize(("shape", "tp"), CASES)
def test_loaders_fed_the_placed_part_hold_what_they_hold_from_hf_tensors(
    shape: ModelShape, tp: int
) -> None:
    shape = dataclasses.replace(shape, vocab_size=100)  # not a multiple of 64
    state = hf_state(shape, torch.bfloat16)
    plan = plan_vllm_fused({n: t.shape[0] for n, t in state.items()}, shape, tp)
    fused = {p.name: (assemble(p, state), p.shard) for p in plan}
    for rank in range(tp):
        parts = [
            RankPart(name, rank_part(tensor, shard, rank, tp), shard)
            for name, (tensor, shard) in fused.items()
        ]
        placed = dict(hf_tensors(parts, shape, rank, tp))
        assert set(placed) == set(state)  # HF names only: never a fused one
        got, want = vllm_rank(placed, shape, tp, rank), vllm_rank(state, shape, tp, rank)
        assert got.keys() == want.keys()
        for name, held in want.items():
            assert torch.equal(got[name], held), (name, rank)


def test_a_default_device_context_does_not_move_the_placed_tensors() -> None:
    """vLLM may run a weight update under ``torch.device("cuda")``; the meta device stands in
    for it on a CPU: the virtual whole tensors stay on their part's device, with its bytes."""
    shape = shape_of(4, 2, 8, hidden=16, inter=32)
    state = hf_state(shape, torch.bfloat16)
    plan = plan_vllm_fused({n: t.shape[0] for n, t in state.items()}, shape, 2)
    parts = []
    for p in plan:
        parts.append(RankPart(p.name, rank_part(assemble(p, state), p.shard, 1, 2), p.shard))
    expected = vllm_rank(dict(hf_tensors(parts, shape, 1, 2)), shape, 2, 1)
    with torch.device("meta"):
        placed = dict(hf_tensors(parts, shape, 1, 2))
    assert {t.device.type for t in placed.values()} == {"cpu"}
    got = vllm_rank(placed, shape, 2, 1)
    assert got.keys() == expected.keys()
    for name, held in expected.items():
        assert torch.equal(got[name], held), name


def test_whole_hf_tensors_pass_through() -> None:
    shape = shape_of(4, 2, 8, hidden=16, inter=32)
    state = hf_state(shape, torch.bfloat16)
    parts = [RankPart(name, tensor, Shard(ShardKind.HF)) for name, tensor in state.items()]
    placed = dict(hf_tensors(parts, shape, 1, 2))
    assert placed.keys() == state.keys()
    assert all(placed[name] is tensor for name, tensor in state.items())


def test_packed_name_is_the_vllm_parameter() -> None:
    assert packed_name("model.layers.3.self_attn.k_proj.weight") == (
        "model.layers.3.self_attn.qkv_proj.weight"
    )
    assert (
        packed_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    )
    assert (
        packed_name("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"
    )
