"""The vllm-fused layout as pure functions.

vLLM shards a Qwen3 attention block with ``QKVParallelLinear`` and the MLP with
``MergedColumnParallelLinear``. For tensor-parallel degree ``tp`` the fused tensor is the
concatenation, over ranks ``r = 0..tp-1``, of the block rank ``r`` holds:

* ``qkv_proj``: ``[q heads of r ; k head(s) of r ; v head(s) of r]``. With ``tp <= kv heads``
  each rank owns ``kv_heads / tp`` kv heads; with ``tp > kv heads`` vLLM replicates them and
  rank ``r`` holds kv head ``r // (tp / kv_heads)``, so the tensor has
  ``q_rows + 2 * tp * head_dim`` rows.
* ``gate_up_proj``: ``[gate rows of r ; up rows of r]``.
* ``o_proj`` / ``down_proj`` (``RowParallelLinear``, split along its input columns): each
  rank's columns ``[:, r * c : (r + 1) * c]`` (``c = columns / tp``), rank after rank along
  dim 0, a ``[tp * rows, c]`` tensor in which each rank's part is contiguous (manifest format
  3; formats 1 and 2 stored the HF tensor, so a rank read every row for its columns).

Every fused tensor is a list of row or column ranges of the HF source tensors
(:mod:`weightcast.contract.regions`), so a conversion is a re-ordering of row-major byte
ranges; :func:`assemble` materialises it.
Everything else keeps its HF name and value, and a tied ``lm_head`` is not written twice.
:func:`unfuse` inverts the layout, for readers that want HF tensors back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightcast.contract.errors import LayoutError
from weightcast.contract.experts import fused_expert_name, unfuse_experts
from weightcast.contract.model_shape import VOCAB_TENSORS, ModelShape, expected_shape
from weightcast.contract.regions import (
    ColumnRange,
    Region,
    RowRange,
    expect_rows,
    join_pieces,
    take_pieces,
)
from weightcast.contract.sharding import Shard, ShardKind

if TYPE_CHECKING:  # torch only for assemble/unfuse; the publish path runs without it
    import torch

_QKV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.q_proj\.(weight|bias)$")
_GATE = re.compile(r"^(model\.layers\.\d+\.mlp)\.gate_proj\.(weight|bias)$")
_FUSED_QKV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.qkv_proj\.(weight|bias)$")
_FUSED_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp)\.gate_up_proj\.(weight|bias)$")
_FUSED_PART = re.compile(r"\.(k_proj|v_proj|up_proj)\.(weight|bias)$")
_ROW_PARALLEL = re.compile(r"\.(o_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class FusedTensor:
    """One output tensor: the concatenation of ``pieces`` along dim 0.

    ``shard`` says how vLLM splits it over tensor-parallel ranks (it goes into the manifest).
    """

    name: str
    pieces: tuple[Region, ...]
    shard: Shard

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)


def check_tp(shape: ModelShape, tp: int) -> None:
    """Raise :class:`LayoutError` for a tp that vLLM itself would refuse for this model."""
    if tp < 1:
        raise LayoutError(f"tp must be >= 1, got {tp}")
    if shape.num_heads % tp:
        raise LayoutError(
            f"tp={tp} does not divide the {shape.num_heads} attention heads; vLLM refuses it"
        )
    kv = shape.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise LayoutError(
            f"tp={tp} and {kv} kv heads: one must divide the other or vLLM refuses it"
        )
    if shape.intermediate_size % tp:
        raise LayoutError(
            f"tp={tp} does not divide intermediate_size {shape.intermediate_size}; vLLM refuses it"
        )


def kv_head_of_rank(shape: ModelShape, tp: int, rank: int) -> tuple[int, int]:
    """The kv heads ``[first, first + count)`` that tensor-parallel rank ``rank`` holds."""
    if tp >= shape.num_kv_heads:
        replicas = tp // shape.num_kv_heads
        return rank // replicas, 1
    per_rank = shape.num_kv_heads // tp
    return rank * per_rank, per_rank


def qkv_pieces(shape: ModelShape, tp: int, q: str, k: str, v: str) -> tuple[RowRange, ...]:
    """Row ranges of q, k, v that make the fused ``qkv_proj`` for ``tp`` ranks."""
    check_tp(shape, tp)
    q_per_rank = shape.q_rows // tp
    pieces: list[RowRange] = []
    for rank in range(tp):
        first, count = kv_head_of_rank(shape, tp, rank)
        kv_start, kv_stop = first * shape.head_dim, (first + count) * shape.head_dim
        pieces += [
            RowRange(q, rank * q_per_rank, (rank + 1) * q_per_rank),
            RowRange(k, kv_start, kv_stop),
            RowRange(v, kv_start, kv_stop),
        ]
    return tuple(pieces)


def gate_up_pieces(shape: ModelShape, tp: int, gate: str, up: str) -> tuple[RowRange, ...]:
    """Row ranges of gate and up that make the fused ``gate_up_proj`` for ``tp`` ranks."""
    check_tp(shape, tp)
    per_rank = shape.intermediate_size // tp
    pieces: list[RowRange] = []
    for rank in range(tp):
        rows = (rank * per_rank, (rank + 1) * per_rank)
        pieces += [RowRange(gate, *rows), RowRange(up, *rows)]
    return tuple(pieces)


def plan_vllm_fused(
    source_rows: Mapping[str, int], shape: ModelShape, tp: int
) -> list[FusedTensor]:
    """Plan the vllm-fused layout of an HF-named state dict.

    ``source_rows`` maps each source tensor name to its size along dim 0. Returns the output
    tensors in the order they should be written. Raises :class:`LayoutError` when a tensor the
    fusion needs is missing or has the wrong number of rows.
    """
    check_tp(shape, tp)
    planned: list[FusedTensor] = []
    consumed: set[str] = set()
    for name in source_rows:
        if m := _QKV.match(name):
            prefix, kind = m.groups()
            q, k, v = (f"{prefix}.{p}_proj.{kind}" for p in "qkv")
            expect_rows(source_rows, {q: shape.q_rows, k: shape.kv_rows, v: shape.kv_rows})
            q_per_rank = shape.q_rows // tp
            kv_per_rank = kv_head_of_rank(shape, tp, 0)[1] * shape.head_dim
            planned.append(
                FusedTensor(
                    f"{prefix}.qkv_proj.{kind}",
                    qkv_pieces(shape, tp, q, k, v),
                    Shard.qkv(tp, q_per_rank, kv_per_rank),
                )
            )
            consumed.update((q, k, v))
        elif m := _GATE.match(name):
            prefix, kind = m.groups()
            gate, up = f"{prefix}.gate_proj.{kind}", f"{prefix}.up_proj.{kind}"
            expect_rows(source_rows, {gate: shape.intermediate_size, up: shape.intermediate_size})
            per_rank = shape.intermediate_size // tp
            planned.append(
                FusedTensor(
                    f"{prefix}.gate_up_proj.{kind}",
                    gate_up_pieces(shape, tp, gate, up),
                    Shard.gate_up(tp, per_rank),
                )
            )
            consumed.update((gate, up))
    for name, rows in source_rows.items():
        if name in consumed or (name == "lm_head.weight" and shape.tie_word_embeddings):
            continue
        if _FUSED_PART.search(name):
            raise LayoutError(f"{name} has no partner to fuse with (q_proj / gate_proj missing)")
        if _ROW_PARALLEL.search(name):
            planned.append(_row_parallel(name, rows, shape, tp))
        else:
            planned.append(FusedTensor(name, (RowRange(name, 0, rows),), _unfused_shard(name)))
    return sorted(planned, key=lambda t: natural_key(t.name))


def _row_parallel(name: str, rows: int, shape: ModelShape, tp: int) -> FusedTensor:
    """``o_proj`` / ``down_proj``: each rank's input columns, rank after rank (one piece of
    whole rows at tp 1, the same bytes)."""
    known = expected_shape(name, shape)
    if known is None or rows != known[0]:
        raise LayoutError(f"{name} has {rows} rows; the config implies {known and known[0]}")
    shard = Shard.row_parallel_ranks(tp, rows)
    if tp == 1:
        return FusedTensor(name, (RowRange(name, 0, rows),), shard)
    per_rank = known[1] // tp
    pieces = tuple(ColumnRange(name, r * per_rank, (r + 1) * per_rank, rows) for r in range(tp))
    return FusedTensor(name, pieces, shard)


def assemble(tensor: FusedTensor, sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Materialise ``tensor`` from the source tensors it is made of.

    A tensor made of one whole source is that source itself (no copy); treat it as read-only.
    """
    import torch

    parts = [
        sources[p.source][:, p.start : p.stop]
        if isinstance(p, ColumnRange)
        else sources[p.source][p.start : p.stop]
        for p in tensor.pieces
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def unfuse(
    tensors: Mapping[str, torch.Tensor], shape: ModelShape, tp: int
) -> dict[str, torch.Tensor]:
    """Invert the layout: the HF-named tensors behind published vllm-fused ones.

    Replicated kv heads appear once per replica; the copies must agree. A tied ``lm_head``
    stays absent, as in HF checkpoints. A row-parallel tensor of a format 1 or 2 version
    (stored as the HF tensor: ``[rows, columns]``, where format 3 has ``[tp * rows, c]``) is
    taken as it is. A mixture of experts' ``FusedMoE`` parameters give back each expert's
    ``gate_proj`` / ``up_proj`` / ``down_proj``
    (:func:`~weightcast.contract.experts.unfuse_experts`).
    """
    experts = {n: t for n, t in tensors.items() if fused_expert_name(n) is not None}
    source_rows: dict[str, int] = {}
    for name, tensor in tensors.items():
        if name in experts:
            continue
        if m := _FUSED_QKV.match(name):
            prefix, kind = m.groups()
            source_rows |= {
                f"{prefix}.q_proj.{kind}": shape.q_rows,
                f"{prefix}.k_proj.{kind}": shape.kv_rows,
                f"{prefix}.v_proj.{kind}": shape.kv_rows,
            }
        elif m := _FUSED_GATE_UP.match(name):
            prefix, kind = m.groups()
            source_rows |= {
                f"{prefix}.gate_proj.{kind}": shape.intermediate_size,
                f"{prefix}.up_proj.{kind}": shape.intermediate_size,
            }
        elif _ROW_PARALLEL.search(name) and (known := expected_shape(name, shape)):
            source_rows[name] = known[0]
        else:
            source_rows[name] = tensor.shape[0]
    sources: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int] = {}
    for plan in plan_vllm_fused(source_rows, shape, tp):
        data = tensors[plan.name]
        old_format = _ROW_PARALLEL.search(plan.name) and data.shape[0] != plan.rows
        if old_format and tuple(data.shape) == expected_shape(plan.name, shape):
            sources[plan.name] = {0: data}  # format 1 or 2: the HF tensor itself
            continue
        if data.shape[0] != plan.rows:
            raise LayoutError(f"{plan.name} has {data.shape[0]} rows; tp={tp} implies {plan.rows}")
        take_pieces(data, plan.pieces, sources, dims)
    return join_pieces(sources, dims) | unfuse_experts(experts, shape, tp)


def _unfused_shard(name: str) -> Shard:
    if name in VOCAB_TENSORS:
        return Shard(ShardKind.VOCAB_PARALLEL)
    return Shard(ShardKind.REPLICATED)


def natural_key(name: str) -> list[Any]:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
