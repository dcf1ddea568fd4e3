"""The scale tensor that goes with a published FP8 weight, planned from the weight's (pure).

A published weight is the concatenation of row or column ranges of HF weights
(:mod:`weightcast.contract.regions`); its ``weight_scale_inv`` is the concatenation of the same
ranges of their scales, in 128-blocks, with the same shard spec counted in blocks. vLLM's FP8
loaders shard a scale exactly so (``BlockQuantScaleParameter``: every offset and size divided
by the block), which is only right when no range cuts a block: each range must start on a block
and hold whole blocks, except the tensor's very last range, which may end at its source's
end (vLLM lets a merged weight's last part be ragged at tp 1). A tp or placement whose ranges
cut a block is refused in one line naming the tensor (:class:`BlockCutError`). vLLM 0.32
refuses such a tp for dense layers (``validate_fp8_block_shape``); for a ``FusedMoE`` it
refines the scale grid instead (``resolve_fp8_moe_weight_block_shape``), which weightcast does
not publish.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weightcast.contract.errors import BlockCutError
from weightcast.contract.fp8 import BLOCK, blocks, scale_name
from weightcast.contract.regions import ColumnRange, Region, RowRange
from weightcast.contract.sharding import Shard, ShardKind


def scale_regions(
    name: str, regions: Sequence[Region], source_shapes: Mapping[str, Sequence[int]]
) -> tuple[Region, ...]:
    """The ranges of the sources' scales that make the scale of weight ``name`` (made of
    ``regions``). Raises :class:`LayoutError` where a range cuts a 128-block."""
    out: list[Region] = []
    for i, region in enumerate(regions):
        rows, cols = source_shapes[region.source][-2:]
        last = i == len(regions) - 1
        if isinstance(region, ColumnRange):
            _whole_blocks(name, region, cols, last, "columns")
            out.append(
                ColumnRange(
                    scale_name(region.source),
                    region.start // BLOCK,
                    blocks(region.stop),
                    blocks(region.rows),
                )
            )
        else:
            _whole_blocks(name, region, rows, last, "rows")
            first, stop = region.start // BLOCK, blocks(region.stop)
            out.append(RowRange(scale_name(region.source), first, stop))
    return tuple(out)


def _whole_blocks(name: str, region: Region, size: int, last: bool, what: str) -> None:
    ragged_end = region.stop % BLOCK and not (last and region.stop == size)
    if region.start % BLOCK or ragged_end:
        raise BlockCutError(
            f"{name}: {what} {region.start}..{region.stop} of {region.source} cut a "
            f"{BLOCK}-block of its FP8 scales; publish FP8 at a tp whose shards are whole "
            f"{BLOCK}-blocks (experts: or with --expert-parallel), or without --quantize"
        )


def scale_shard(shard: Shard) -> Shard:
    """A weight's shard spec counted in blocks (for the rows of its scale)."""
    if shard.kind == ShardKind.QKV:
        assert shard.tp and shard.q_rows and shard.kv_rows
        return Shard.qkv(shard.tp, blocks(shard.q_rows), blocks(shard.kv_rows))
    if shard.kind == ShardKind.GATE_UP:
        assert shard.tp and shard.gate_rows
        return Shard.gate_up(shard.tp, blocks(shard.gate_rows))
    if shard.kind == ShardKind.ROW_PARALLEL_RANKS:
        assert shard.tp and shard.out_rows
        return Shard.row_parallel_ranks(shard.tp, blocks(shard.out_rows))
    return shard  # experts (rows are experts), replicated, whole HF tensors


def scale_rows(shape: Sequence[int], regions: Sequence[Region]) -> tuple[int, ...]:
    """The shape of a scale made of ``regions`` for a weight of ``shape``: 2-D, its rows
    the regions' (in blocks); 3-D (experts), ``[experts, rows / experts, column blocks]``."""
    total = sum(r.rows for r in regions)
    cols = regions[0].stop - regions[0].start if isinstance(regions[0], ColumnRange) else None
    width = cols if cols is not None else blocks(shape[-1])
    if len(shape) == 3:
        return (shape[0], total // shape[0], width)
    return (total, width)
