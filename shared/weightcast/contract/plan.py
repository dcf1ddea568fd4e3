"""The publish plan of a version, pure: which files, which tensors in each (name, dtype,
shape, shard) and which regions of which source tensors make each of them. The publisher only
resolves regions to bytes and writes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weightcast.contract.block_scales import scale_regions, scale_rows, scale_shard
from weightcast.contract.errors import LayoutError
from weightcast.contract.experts import ExpertTensor, is_expert_source, plan_experts
from weightcast.contract.fp8 import scale_name, weight_name
from weightcast.contract.fusion import FusedTensor, natural_key, plan_vllm_fused
from weightcast.contract.layout import (
    FUSED_WEIGHTS_FILE,
    HF_DIR,
    LAYOUT_BOTH,
    LAYOUT_HF,
    LAYOUT_VLLM_FUSED,
    LAYOUTS,
    fused_rank_file,
    hf_file_name,
)
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.regions import ColumnRange, Region, RowRange
from weightcast.contract.sharding import Shard, ShardKind, rank_slice
from weightcast.contract.tensorfile import nbytes

HF_SHARD_BYTES = 5 * 10**9
"""transformers' default ``max_shard_size`` ("5GB")."""


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor of a published file: the concatenation of ``regions`` (row-major bytes).

    ``shard`` and ``rank`` are what the manifest records (see
    :func:`~weightcast.contract.sharding.rank_slice`).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    regions: tuple[Region, ...]
    shard: Shard
    rank: int | None = None

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class PlannedFile:
    """A safetensors file of the version; ``name`` is relative to the version directory."""

    name: str
    tensors: tuple[PlannedTensor, ...]


@dataclass(frozen=True)
class VersionPlan:
    """Every safetensors file of a version. ``listed`` are the files whose tensors the
    manifest lists (the fused ones, or the HF ones for ``layout == "hf"``); ``hf_index`` is
    the HF index's ``weight_map`` (tensor -> file name inside the HF directory), if any."""

    layout: str
    tp: int
    per_rank_files: bool
    fused: tuple[PlannedFile, ...]
    hf: tuple[PlannedFile, ...]
    hf_dir: str | None
    ep: int | None = None
    """The expert parallelism the fused experts are laid out for (None: no experts)."""

    @property
    def files(self) -> tuple[PlannedFile, ...]:
        return self.fused + self.hf

    @property
    def listed(self) -> tuple[PlannedFile, ...]:
        return self.fused if self.fused else self.hf

    @property
    def hf_index(self) -> dict[str, str]:
        prefix = f"{self.hf_dir}/" if self.hf_dir else ""
        return {
            t.name: f.name.removeprefix(prefix)
            for f in sorted(self.hf, key=lambda f: f.name)
            for t in f.tensors
        }


def plan_version(
    sources: Mapping[str, tuple[str, Sequence[int]]],
    shape: ModelShape,
    tp: int,
    layout: str = LAYOUT_VLLM_FUSED,
    per_rank_files: bool = False,
    ep: int = 1,
) -> VersionPlan:
    """Plan the files of a version from the snapshot's tensors (name -> (dtype, shape)).

    ``vllm-fused``: ``model.vllm-fused`` with the fused tensors, or with ``per_rank_files``
    (tp > 1) one ``model-rank-RR-of-TT.vllm-fused`` per rank holding exactly what
    :func:`rank_slice` gives that rank. ``hf``: the source tensors as they are (a tied
    ``lm_head`` left out) in shards of at most :data:`HF_SHARD_BYTES`. ``both``: the fused
    files, and the HF shards under ``hf/``. A mixture of experts' expert tensors become
    vLLM's ``FusedMoE`` parameters for ``ep`` (1, or ``tp`` for expert parallelism; see
    :mod:`weightcast.contract.experts`). Raises :class:`LayoutError`.
    """
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    per_rank = per_rank_files and tp > 1
    fused: tuple[PlannedFile, ...] = ()
    if layout != LAYOUT_HF:
        rows = {n: s[0] for n, (_, s) in sources.items() if weight_name(n) not in sources}
        dense = {n: r for n, r in rows.items() if not is_expert_source(n)}
        whole = [_fused_whole(p, sources) for p in plan_vllm_fused(dense, shape, tp)]
        if shape.moe:
            whole += [_expert_whole(p, sources) for p in plan_experts(rows, shape, tp, ep)]
        whole += [_scale_of(t, sources) for t in whole if _scaled(t, sources)]
        whole.sort(key=lambda t: natural_key(t.name))
        if per_rank:
            fused = tuple(
                PlannedFile(
                    fused_rank_file(rank, tp), tuple(_rank_part(t, rank, tp) for t in whole)
                )
                for rank in range(tp)
            )
        else:
            fused = (PlannedFile(FUSED_WEIGHTS_FILE, tuple(whole)),)
    hf: tuple[PlannedFile, ...] = ()
    hf_dir = HF_DIR if layout == LAYOUT_BOTH else None
    if layout != LAYOUT_VLLM_FUSED:
        hf = _hf_files(sources, shape, f"{hf_dir}/" if hf_dir else "")
    placed = ep if shape.moe and layout != LAYOUT_HF else None
    return VersionPlan(layout, tp, per_rank, fused, hf, hf_dir, placed)


def _fused_whole(p: FusedTensor, sources: Mapping[str, tuple[str, Sequence[int]]]) -> PlannedTensor:
    first, piece = tuple(sources[p.pieces[0].source][1]), p.pieces[0]
    trailing = (piece.stop - piece.start,) if isinstance(piece, ColumnRange) else first[1:]
    dtype = _one_dtype(p.name, p.pieces, sources)
    return PlannedTensor(p.name, dtype, (p.rows, *trailing), p.pieces, p.shard)


def _expert_whole(
    p: ExpertTensor, sources: Mapping[str, tuple[str, Sequence[int]]]
) -> PlannedTensor:
    return PlannedTensor(p.name, _one_dtype(p.name, p.pieces, sources), p.shape, p.pieces, p.shard)


def _scaled(tensor: PlannedTensor, sources: Mapping[str, tuple[str, Sequence[int]]]) -> bool:
    """Whether ``tensor`` is made of FP8 weights, each with its scales among the sources."""
    return tensor.name.endswith("weight") and all(
        r.source.endswith("weight") and scale_name(r.source) in sources for r in tensor.regions
    )


def _scale_of(
    tensor: PlannedTensor, sources: Mapping[str, tuple[str, Sequence[int]]]
) -> PlannedTensor:
    """The scale of the FP8 weight ``tensor``: the same ranges of its sources' scales."""
    shapes = {r.source: sources[r.source][1] for r in tensor.regions}
    regions = scale_regions(tensor.name, tensor.regions, shapes)
    name = scale_name(tensor.name)
    dtype = _one_dtype(name, regions, sources)
    return PlannedTensor(
        name, dtype, scale_rows(tensor.shape, regions), regions, scale_shard(tensor.shard)
    )


def _one_dtype(
    name: str, pieces: Sequence[Region], sources: Mapping[str, tuple[str, Sequence[int]]]
) -> str:
    dtypes = {sources[piece.source][0] for piece in pieces}
    if len(dtypes) != 1:
        raise LayoutError(f"{name}: its parts have different dtypes {sorted(dtypes)}")
    return dtypes.pop()


def _rank_part(whole: PlannedTensor, rank: int, tp: int) -> PlannedTensor:
    """What vLLM's rank ``rank`` holds of ``whole`` (a fused or unfused tensor)."""
    part = rank_slice(whole.shard, whole.shape, rank, tp)
    if part is None:
        return PlannedTensor(whole.name, whole.dtype, whole.shape, whole.regions, whole.shard, rank)
    if whole.shard.kind == ShardKind.EXPERTS:
        # Rows here are experts (dim 0 of a 3-D tensor), each made of the same number of pieces.
        per_expert = len(whole.regions) // whole.shape[0]
        regions = whole.regions[part.start * per_expert : part.stop * per_expert]
        size = (part.stop - part.start, *whole.shape[1:])
        return PlannedTensor(whole.name, whole.dtype, size, regions, whole.shard, rank)
    if part.dim != 0:
        raise LayoutError(f"{whole.name}: cannot split along dim {part.dim}")
    regions = _rows_of(whole.name, whole.regions, part.start, part.stop)
    size = (part.stop - part.start, *whole.shape[1:])
    return PlannedTensor(whole.name, whole.dtype, size, regions, whole.shard, rank)


def _rows_of(name: str, regions: Sequence[Region], start: int, stop: int) -> tuple[Region, ...]:
    """Rows ``[start, stop)`` of the concatenation of ``regions``: parts of row ranges, and
    column ranges whole (a rank's part never cuts one)."""
    out: list[Region] = []
    at = 0
    for region in regions:
        lo, hi = max(start, at), min(stop, at + region.rows)
        if lo < hi and isinstance(region, ColumnRange):
            if (lo, hi) != (at, at + region.rows):
                raise LayoutError(f"{name}: rows {start}..{stop} cut a rank's columns")
            out.append(region)
        elif lo < hi:
            first = region.start + lo - at
            out.append(RowRange(region.source, first, first + hi - lo))
        at += region.rows
    return tuple(out)


def _hf_files(
    sources: Mapping[str, tuple[str, Sequence[int]]], shape: ModelShape, prefix: str
) -> tuple[PlannedFile, ...]:
    tensors = [
        PlannedTensor(name, dtype, tuple(size), _whole(name, size), Shard(ShardKind.HF))
        for name, (dtype, size) in sources.items()
        if not (name == "lm_head.weight" and shape.tie_word_embeddings)
    ]
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > HF_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return tuple(
        PlannedFile(prefix + hf_file_name(i, len(shards)), tuple(shard))
        for i, shard in enumerate(shards, start=1)
    )


def _whole(name: str, size: Sequence[int]) -> tuple[Region, ...]:
    return (RowRange(name, 0, size[0] if size else 1),)
