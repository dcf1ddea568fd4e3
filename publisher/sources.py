"""The snapshot's tensors as byte pieces: row blocks and column blocks of row-major tensors.

:class:`DcpSource` points into the snapshot's DCP files (nothing is read until the writer
copies); :class:`MemorySource` wraps tensors that ``dcp.load`` produced, the fallback for
snapshots whose storage the byte-range path does not recognise. Both give the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from weightcast.publisher.dcp_index import SourceTensor
from weightcast.publisher.safetensors_writer import Columns, FileRange, Piece


class DcpSource:
    """Byte ranges inside the snapshot's ``.distcp`` files."""

    kind = "byte-range"

    def __init__(self, index: Mapping[str, SourceTensor]) -> None:
        self.index = index

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (t.shape, t.dtype) for name, t in self.index.items()}

    def rows(self, name: str, start: int, stop: int) -> list[Piece]:
        tensor = self.index[name]
        pieces: list[Piece] = []
        for chunk in tensor.chunks:
            lo, hi = max(start, chunk.row_start), min(stop, chunk.row_stop)
            if lo < hi:
                offset = chunk.offset + (lo - chunk.row_start) * tensor.row_bytes
                pieces.append(FileRange(chunk.file, offset, (hi - lo) * tensor.row_bytes))
        return _merge(pieces)

    def columns(self, name: str, start: int, stop: int) -> list[Piece]:
        tensor = self.index[name]
        item = tensor.dtype.itemsize
        return [
            Columns(
                chunk.file,
                chunk.offset,
                chunk.row_stop - chunk.row_start,
                tensor.row_bytes,
                start * item,
                (stop - start) * item,
            )
            for chunk in tensor.chunks
        ]


class MemorySource:
    """Tensors in memory (from ``dcp.load``)."""

    kind = "dcp-load"

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(t.shape), t.dtype) for name, t in self.tensors.items()}

    def rows(self, name: str, start: int, stop: int) -> list[Piece]:
        return [_bytes_of(self.tensors[name][start:stop])]

    def columns(self, name: str, start: int, stop: int) -> list[Piece]:
        return [_bytes_of(self.tensors[name][:, start:stop])]


Source = DcpSource | MemorySource


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    if math.prod(flat.shape) == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Join file ranges that follow each other in the same file (fewer copy calls)."""
    merged: list[Piece] = []
    for piece in pieces:
        last = merged[-1] if merged else None
        if (
            isinstance(piece, FileRange)
            and isinstance(last, FileRange)
            and last.file == piece.file
            and last.offset + last.length == piece.offset
        ):
            merged[-1] = FileRange(last.file, last.offset, last.length + piece.length)
        else:
            merged.append(piece)
    return merged
