"""How vLLM splits a published tensor over tensor-parallel ranks: the manifest's shard spec as
a type (:class:`Shard`), and the part of a tensor each rank holds (:func:`rank_slice`).

A shard spec comes from ``manifest.json``, so :meth:`Shard.from_json` checks every field (a
known kind, integers that are integers, rows that add up) and :meth:`Shard.check` checks it
against the tensor it describes, so that no rank's slice can reach past the tensor.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightcast.contract.errors import LayoutError
from weightcast.contract.untrusted import shown

VOCAB_PADDING = 64
"""vLLM pads the vocabulary to a multiple of this before splitting it over ranks."""


class ShardKind(enum.StrEnum):
    """How vLLM shards a tensor (the manifest's ``shard.kind``)."""

    QKV = "qkv"
    """A fused ``qkv_proj``: each rank's ``[q; k; v]`` rows, rank after rank."""
    GATE_UP = "gate_up"
    """A fused ``gate_up_proj``: each rank's ``[gate; up]`` rows, rank after rank."""
    VOCAB_PARALLEL = "vocab_parallel"
    """Rows of the padded vocabulary (``VocabParallelEmbedding``)."""
    ROW_PARALLEL = "row_parallel"
    """Input columns (``RowParallelLinear``: ``o_proj``, ``down_proj``), strided: the HF
    tensor as it is (manifest formats 1 and 2)."""
    ROW_PARALLEL_RANKS = "row_parallel_ranks"
    """``RowParallelLinear`` laid out per rank (format 3): each rank's input columns, a
    ``[out_rows, columns / tp]`` part, rank after rank along dim 0, so that a rank's part is
    one contiguous range."""
    EXPERTS = "experts"
    """vLLM's fused ``FusedMoE`` parameters (``w13_weight``, ``w2_weight``): each rank's
    ``[experts, ...]`` block, rank after rank (see :mod:`weightcast.contract.experts`)."""
    REPLICATED = "replicated"
    """Every rank holds all of it."""
    HF = "hf"
    """A whole HF tensor; vLLM's own loaders take each rank's share."""


FUSED_KINDS = (
    ShardKind.QKV,
    ShardKind.GATE_UP,
    ShardKind.ROW_PARALLEL_RANKS,
    ShardKind.EXPERTS,
)
"""Kinds laid out for one tp, each rank's ``rank_rows`` rows after the previous rank's."""
_DIMS = {
    ShardKind.QKV: 0,
    ShardKind.GATE_UP: 0,
    ShardKind.ROW_PARALLEL_RANKS: 0,
    ShardKind.EXPERTS: 0,
    ShardKind.VOCAB_PARALLEL: 0,
    ShardKind.ROW_PARALLEL: 1,
}
_ROW_FIELDS = {
    ShardKind.QKV: ("q_rows", "kv_rows"),
    ShardKind.GATE_UP: ("gate_rows",),
    ShardKind.ROW_PARALLEL_RANKS: ("out_rows",),
    ShardKind.EXPERTS: ("ep", "experts"),
}
_NUMBERS = ("tp", "q_rows", "kv_rows", "gate_rows", "out_rows", "ep", "experts")


@dataclass(frozen=True)
class Shard:
    """A tensor's shard spec. Fused kinds carry the tp they were laid out for and each rank's
    rows: ``q_rows`` and ``kv_rows`` (qkv: ``rank_rows = q_rows + 2 * kv_rows``),
    ``gate_rows`` (gate_up: ``rank_rows = 2 * gate_rows``), ``out_rows`` (row_parallel_ranks:
    the HF tensor's rows, ``rank_rows = out_rows``) or ``ep`` and ``experts`` (experts:
    ``rank_rows = experts``, the experts each rank holds; ``ep`` is 1 when every rank holds
    every expert's slice of the intermediate dimension, ``tp`` when each rank holds whole
    experts: vLLM's expert parallelism spans all ranks or none)."""

    kind: ShardKind
    tp: int | None = None
    q_rows: int | None = None
    kv_rows: int | None = None
    gate_rows: int | None = None
    out_rows: int | None = None
    ep: int | None = None
    experts: int | None = None

    def __post_init__(self) -> None:
        numbers = {"tp", *_ROW_FIELDS.get(self.kind, ())} if self.fused else set()
        for name in _NUMBERS:
            if (getattr(self, name) is None) == (name in numbers):
                raise LayoutError(
                    f"a {self.kind} shard {'needs' if name in numbers else 'has no'} {name}"
                )
        if self.ep is not None and self.ep not in (1, self.tp):
            raise LayoutError(
                f"ep {self.ep} with tp={self.tp}: vLLM's expert parallelism spans every rank "
                f"or none (ep 1 or {self.tp})"
            )

    @classmethod
    def qkv(cls, tp: int, q_rows: int, kv_rows: int) -> Shard:
        return cls(ShardKind.QKV, tp=tp, q_rows=q_rows, kv_rows=kv_rows)

    @classmethod
    def gate_up(cls, tp: int, gate_rows: int) -> Shard:
        return cls(ShardKind.GATE_UP, tp=tp, gate_rows=gate_rows)

    @classmethod
    def row_parallel_ranks(cls, tp: int, out_rows: int) -> Shard:
        return cls(ShardKind.ROW_PARALLEL_RANKS, tp=tp, out_rows=out_rows)

    @classmethod
    def expert_block(cls, tp: int, ep: int, experts: int) -> Shard:
        return cls(ShardKind.EXPERTS, tp=tp, ep=ep, experts=experts)

    @property
    def dim(self) -> int | None:
        """The dimension ranks split (None: not split here)."""
        return _DIMS.get(self.kind)

    @property
    def fused(self) -> bool:
        return self.kind in FUSED_KINDS

    @property
    def rank_rows(self) -> int:
        """The rows each rank holds of a fused tensor (0 for other kinds)."""
        if self.kind == ShardKind.QKV:
            return (self.q_rows or 0) + 2 * (self.kv_rows or 0)
        if self.kind == ShardKind.ROW_PARALLEL_RANKS:
            return self.out_rows or 0
        if self.kind == ShardKind.EXPERTS:
            return self.experts or 0
        return 2 * (self.gate_rows or 0)

    def as_json(self) -> dict[str, Any]:
        """What the manifest records (``dim`` and ``rank_rows`` too, for older readers)."""
        out: dict[str, Any] = {"kind": str(self.kind)}
        if self.dim is not None:
            out["dim"] = self.dim
        if self.fused:
            out |= {"tp": self.tp, "rank_rows": self.rank_rows}
            out |= {name: getattr(self, name) for name in _ROW_FIELDS[self.kind]}
        return out

    @classmethod
    def from_json(cls, raw: object) -> Shard:
        """Parse a manifest's shard spec; :class:`LayoutError` names the field at fault."""
        if not isinstance(raw, Mapping):
            raise LayoutError(f"is {shown(raw)}, not an object")
        try:
            kind = ShardKind(raw.get("kind"))
        except ValueError:
            raise LayoutError(
                f"kind {shown(raw.get('kind'))} is not one of {_KIND_NAMES}"
            ) from None
        fields = {"kind", *(("dim",) if kind in _DIMS else ())}
        if kind in FUSED_KINDS:
            fields |= {"tp", "rank_rows", *_ROW_FIELDS[kind]}
        if extra := sorted(set(raw) - fields, key=str):
            raise LayoutError(f"has fields a {kind} shard does not: {shown(extra)}")
        if "dim" in raw and (type(raw["dim"]) is not int or raw["dim"] != _DIMS[kind]):
            raise LayoutError(f"dim {shown(raw['dim'])}: a {kind} shard splits dim {_DIMS[kind]}")
        if kind not in FUSED_KINDS:
            return cls(kind)
        numbers = {name: _positive(raw, name) for name in ("tp", *_ROW_FIELDS[kind])}
        shard = cls(kind, **numbers)
        if _positive(raw, "rank_rows") != shard.rank_rows:
            raise LayoutError(f"rank_rows {raw['rank_rows']} is not the sum of its parts")
        return shard

    def check(self, shape: Sequence[int], tp: int, whole: bool) -> None:
        """Raise :class:`LayoutError` unless this spec fits a tensor of ``shape`` in a version
        for ``tp`` ranks: ``whole``, every rank's slice lies inside it; else (one rank's part,
        in a per-rank file) it has the rank's rows."""
        if self.kind == ShardKind.HF:
            return
        if whole:
            rank_slice(self, shape, 0, tp)
            return
        _check_dims(self, shape)
        if self.fused and (self.tp != tp or shape[0] != self.rank_rows):
            raise LayoutError(
                f"a rank's part of {self.rank_rows} rows for tp={self.tp} in a tensor of "
                f"{list(shape)} of a tp={tp} version"
            )


_KIND_NAMES = ", ".join(kind.value for kind in ShardKind)


def _check_dims(shard: Shard, shape: Sequence[int]) -> None:
    if shard.dim is not None and len(shape) <= shard.dim:
        raise LayoutError(f"a {shard.kind} tensor of shape {list(shape)} has no dim {shard.dim}")
    if shard.kind in (ShardKind.ROW_PARALLEL, ShardKind.ROW_PARALLEL_RANKS) and len(shape) != 2:
        raise LayoutError(f"a {shard.kind} tensor is a matrix, not {list(shape)}")
    if shard.kind == ShardKind.EXPERTS and len(shape) != 3:
        raise LayoutError(f"an {shard.kind} tensor has 3 dimensions, not {list(shape)}")


def _positive(raw: Mapping[str, Any], name: str) -> int:
    value = raw.get(name)
    if type(value) is not int or value < 1:
        raise LayoutError(f"{name} {shown(value)} is not a positive integer")
    return value


@dataclass(frozen=True)
class RankSlice:
    """Rank ``r``'s part of a tensor: indices ``[start, stop)`` along ``dim``."""

    dim: int
    start: int
    stop: int


def rank_slice(shard: Shard, shape: Sequence[int], rank: int, tp: int) -> RankSlice | None:
    """Which part of a published tensor vLLM's tensor-parallel rank ``rank`` holds.

    ``shape`` is the tensor's full published shape. None means the rank holds all of it
    (replicated). Fused tensors were laid out for one tp and cannot serve another.
    Vocab-parallel tensors follow ``VocabParallelEmbedding``: the vocabulary padded to a
    multiple of 64, split evenly, the padding rows absent here. A slice never reaches past
    ``shape`` (:class:`LayoutError`).
    """
    if not 0 <= rank < tp:
        raise LayoutError(f"rank {rank} is outside tp={tp}")
    _check_dims(shard, shape)
    if shard.fused:
        if shard.tp != tp:
            raise LayoutError(f"a tensor fused for tp={shard.tp} cannot serve tp={tp}")
        rows = shard.rank_rows
        if rows * tp != shape[0]:
            raise LayoutError(f"{tp} ranks of {rows} rows do not make {shape[0]} rows")
        return RankSlice(0, rank * rows, (rank + 1) * rows)
    if shard.kind == ShardKind.VOCAB_PARALLEL:
        vocab = shape[0]
        per_rank = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING // tp
        if per_rank * tp % VOCAB_PADDING:
            raise LayoutError(f"tp={tp} does not divide the padded vocabulary of {vocab}")
        return RankSlice(0, min(rank * per_rank, vocab), min((rank + 1) * per_rank, vocab))
    if shard.kind == ShardKind.ROW_PARALLEL:
        columns = shape[1]
        if columns % tp:
            raise LayoutError(f"tp={tp} does not divide the {columns} input columns")
        per_rank = columns // tp
        return RankSlice(1, rank * per_rank, (rank + 1) * per_rank)
    if shard.kind == ShardKind.REPLICATED:
        return None
    raise LayoutError(f"a {shard.kind} tensor has no rank slices")
