"""The pieces a published tensor is made of: row or column ranges of HF source tensors, and
cutting a published tensor back into them (pure; torch only for the cutting).

Both fused layouts, the dense one (:mod:`weightcast.contract.fusion`) and the experts'
(:mod:`weightcast.contract.experts`), describe every tensor they publish as a sequence of
these regions, concatenated along dim 0 in row-major bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightcast.contract.errors import LayoutError

if TYPE_CHECKING:  # torch only for take_pieces/join_pieces; the publish path runs without it
    import torch


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` along dim 0 of the source tensor ``source``."""

    source: str
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ColumnRange:
    """Columns ``[start, stop)`` of all ``rows`` rows of the 2-D source tensor ``source``."""

    source: str
    start: int
    stop: int
    rows: int


Region = RowRange | ColumnRange


def expect_rows(source_rows: Mapping[str, int], expected: Mapping[str, int]) -> None:
    """Raise :class:`LayoutError` unless every source is there with the rows it must have."""
    for name, rows in expected.items():
        if name not in source_rows:
            raise LayoutError(f"{name} is missing from the snapshot")
        if source_rows[name] != rows:
            raise LayoutError(f"{name} has {source_rows[name]} rows; the config implies {rows}")


def take_pieces(
    data: torch.Tensor,
    pieces: Sequence[Region],
    sources: dict[str, dict[int, torch.Tensor]],
    dims: dict[str, int],
) -> None:
    """Cut ``data`` (2-D: the concatenation of ``pieces`` along dim 0) back into its pieces,
    into ``sources[source][start]``; ``dims[source]`` is the dim :func:`join_pieces` joins
    them along. Raises :class:`LayoutError` where two replicas of one piece disagree."""
    import torch

    offset = 0
    for piece in pieces:
        block = data[offset : offset + piece.rows]
        offset += piece.rows
        dims[piece.source] = 1 if isinstance(piece, ColumnRange) else 0
        seen = sources.setdefault(piece.source, {})
        if piece.start in seen and not torch.equal(seen[piece.start], block):
            raise LayoutError(f"replicas of {piece.source} rows {piece.start}.. disagree")
        seen[piece.start] = block


def join_pieces(
    sources: Mapping[str, Mapping[int, torch.Tensor]], dims: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """Each source tensor from the pieces :func:`take_pieces` cut, in order of their start."""
    import torch

    return {
        name: torch.cat([block for _, block in sorted(blocks.items())], dim=dims.get(name, 0))
        for name, blocks in sources.items()
    }
