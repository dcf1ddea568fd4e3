"""Feed one rank's part of a version to vLLM's own loaders, under HF names (pure functions).

vLLM's ``model.load_weights`` is meant for checkpoint tensors: HF names, whole (unsharded)
tensors; each parameter's ``weight_loader`` narrows to its rank's share (and fuses q, k, v
into ``qkv_proj``, gate and up into ``gate_up_proj``). Fused names are NOT refused there: a
``qkv_proj`` tensor reaches ``QKVParallelLinear`` as one ``[Q; K; V]`` concatenation of every
head, which the published layout is only at tp=1, so at tp > 1 it loads silently wrong.

So a rank hands vLLM HF-named "virtual whole" tensors: whole-shaped, with only the rows (or
columns) its loaders will narrow to written, from its own part; the rest is never read (and,
for large allocations, never committed to memory). Offsets are the loaders' own:
``QKVParallelLinear`` (q at ``rank * q_rows``, k/v at the first kv head of the rank times
head_dim, replicated when tp exceeds the kv heads), ``MergedColumnParallelLinear`` (gate and up
at ``rank * rows``), ``VocabParallelEmbedding`` and ``RowParallelLinear``
(``sharding.rank_slice``). ``tests/vllm_reference.py`` re-implements those loaders to check it.
An FP8 version's scales (``weight_scale_inv``) are placed as their weights, in 128-blocks, as
vLLM's ``BlockQuantScaleParameter`` and ``FusedMoE`` block-scale loaders narrow them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from weightcast.client.vllm.staging import RankPart
from weightcast.contract.errors import LayoutError
from weightcast.contract.experts import (
    FUSED_MOE,
    W2,
    W13,
    fused_expert_name,
    intermediate_of_rank,
    local_experts,
)
from weightcast.contract.fp8 import BLOCK, weight_name
from weightcast.contract.fusion import kv_head_of_rank
from weightcast.contract.model_shape import ModelShape, expected_shape
from weightcast.contract.sharding import ShardKind, rank_slice

_PACKED = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight(_scale_inv)?$"
)
_PACKED_INTO = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def packed_name(hf_name: str) -> str:
    """The vLLM parameter an HF tensor loads into (``q_proj`` -> ``qkv_proj``..., an
    expert's ``gate_proj`` -> the layer's ``FusedMoE`` ``w13_weight``)."""
    if m := _EXPERT.match(hf_name):
        scale = "_scale_inv" if m.group(3) else ""
        return f"{m.group(1)}.{FUSED_MOE}.{W2 if m.group(2) == 'down' else W13}{scale}"
    return _PACKED.sub(lambda m: f".{_PACKED_INTO[m.group(1)]}.", hf_name)


def hf_tensors(
    parts: Iterable[RankPart], shape: ModelShape, rank: int, tp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` pairs that make vLLM's loaders on ``rank`` hold ``parts``."""
    for part in parts:
        kind = part.shard.kind
        if kind == ShardKind.HF:
            yield part.name, part.tensor
        elif kind == ShardKind.QKV:
            yield from _split_qkv(part, shape, rank, tp)
        elif kind == ShardKind.GATE_UP:
            yield from _split_gate_up(part, shape, rank)
        elif kind == ShardKind.ROW_PARALLEL_RANKS:  # the rank's [rows, columns / tp]
            columns = part.tensor.shape[1]
            whole = (part.tensor.shape[0], columns * tp)
            yield part.name, _placed(part.tensor, whole, 1, rank * columns)
        elif kind == ShardKind.EXPERTS:
            yield from _split_experts(part, shape, rank)
        else:
            whole = expected_shape(part.name, shape)
            if whole is None:
                raise LayoutError(f"{part.name}: not a tensor of a dense Qwen3")
            piece = rank_slice(part.shard, whole, rank, tp)
            if piece is None:  # replicated: every rank holds it whole
                yield part.name, part.tensor
            else:
                yield part.name, _placed(part.tensor, whole, piece.dim, piece.start)


def _split_qkv(
    part: RankPart, shape: ModelShape, rank: int, tp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    prefix, suffix = part.name.rsplit(".qkv_proj.", 1)
    unit = _unit(part.name)
    q_rows, kv_rows = part.shard.q_rows or 0, part.shard.kv_rows or 0
    q, k, v = part.tensor.split([q_rows, kv_rows, kv_rows])
    rest = tuple(part.tensor.shape[1:])
    kv_start = kv_head_of_rank(shape, tp, rank)[0] * shape.head_dim // unit
    q_whole, kv_whole = (_in(shape.q_rows, unit), *rest), (_in(shape.kv_rows, unit), *rest)
    yield f"{prefix}.q_proj.{suffix}", _placed(q, q_whole, 0, rank * q_rows)
    yield f"{prefix}.k_proj.{suffix}", _placed(k, kv_whole, 0, kv_start)
    yield f"{prefix}.v_proj.{suffix}", _placed(v, kv_whole, 0, kv_start)


def _split_gate_up(
    part: RankPart, shape: ModelShape, rank: int
) -> Iterator[tuple[str, torch.Tensor]]:
    prefix, suffix = part.name.rsplit(".gate_up_proj.", 1)
    rows = part.shard.gate_rows or 0
    gate, up = part.tensor.split([rows, rows])
    whole = (_in(shape.intermediate_size, _unit(part.name)), *part.tensor.shape[1:])
    yield f"{prefix}.gate_proj.{suffix}", _placed(gate, whole, 0, rank * rows)
    yield f"{prefix}.up_proj.{suffix}", _placed(up, whole, 0, rank * rows)


def _split_experts(
    part: RankPart, shape: ModelShape, rank: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each local expert's HF tensors, placed where ``FusedMoE.weight_loader`` narrows to
    (its rank's rows of gate and up, columns of down; whole experts under expert parallelism)."""
    named = fused_expert_name(weight_name(part.name) or part.name)
    if named is None:
        raise LayoutError(f"{part.name}: not a FusedMoE parameter of a Qwen3-MoE")
    prefix, _, which = named
    ep, tp = part.shard.ep or 1, part.shard.tp or 1
    unit = _unit(part.name)
    start, stop = (i // unit for i in intermediate_of_rank(shape, ep, tp, rank))
    size, h = _in(shape.moe_intermediate_size, unit), _in(shape.hidden_size, unit)
    scale = "_scale_inv" if unit > 1 else ""
    experts = local_experts(shape, ep, rank)
    if len(experts) != part.tensor.shape[0]:
        raise LayoutError(
            f"{part.name}: {part.tensor.shape[0]} experts, rank {rank} has {len(experts)}"
        )
    for block, expert in zip(part.tensor, experts, strict=True):
        name = f"{prefix}.mlp.experts.{expert}"
        if which == W13:
            gate, up = block.split(stop - start)
            yield f"{name}.gate_proj.weight{scale}", _placed(gate, (size, h), 0, start)
            yield f"{name}.up_proj.weight{scale}", _placed(up, (size, h), 0, start)
        else:
            yield f"{name}.down_proj.weight{scale}", _placed(block, (h, size), 1, start)


def _unit(name: str) -> int:
    """Rows per row of ``name``: a 128-block for an FP8 scale (``weight_scale_inv``), else 1."""
    return BLOCK if weight_name(name) is not None else 1


def _in(size: int, unit: int) -> int:
    """``size`` rows counted in ``unit``s (a ragged last block counts)."""
    return -(-size // unit)


def _placed(part: torch.Tensor, whole: tuple[int, ...], dim: int, start: int) -> torch.Tensor:
    """A tensor of shape ``whole`` holding ``part`` at ``start`` along ``dim`` (the rest is
    uninitialised: the loaders never read it)."""
    if tuple(part.shape) == tuple(whole):
        return part
    buffer = torch.empty(whole, dtype=part.dtype, device=part.device)  # not the default device
    buffer.narrow(dim, start, part.shape[dim]).copy_(part)
    return buffer
