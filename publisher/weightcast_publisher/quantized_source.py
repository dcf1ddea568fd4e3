"""A snapshot's tensors as block-scaled FP8 (``publisher.quantize fp8``): a source over a source.

:class:`QuantizedSource` shows every linear weight of the snapshot
(:func:`weightcast.contract.fp8.is_quantized`) as ``F8_E4M3`` with its ``weight_scale_inv``
beside it, and every other tensor as it is. The plan and the writer then treat them like any
other tensor: a fused weight is ranges of FP8 weights, its scale the same ranges of their
scales (:mod:`weightcast.contract.block_scales`). Bytes are computed when the writer reaches
them (:class:`~weightcast_publisher.safetensors_writer.Computed`): a weight's scales once, on
first use, from one read of the weight (they are small and kept: a file writes its float32
scales before its FP8 weights); each range of a weight from a read of that range alone, under
those scales. Memory holds one tensor at a time, whatever the model's size.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from weightcast.contract import fp8
from weightcast.contract.plan import PlannedFile
from weightcast.contract.regions import ColumnRange, Region, RowRange
from weightcast.contract.tensorfile import DTYPE_SIZES, TORCH_NAMES, TensorSpan
from weightcast_publisher.safetensors_writer import (
    Columns,
    Computed,
    FileRange,
    Piece,
    SourceEnded,
)
from weightcast_publisher.snapshot_scan import CorruptSnapshot
from weightcast_publisher.sources import Source

if TYPE_CHECKING:
    import torch

_FLOATS = ("BF16", "F16", "F32")


class QuantizedSource:
    """``inner``'s tensors, its linear weights as FP8 with their scales."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.quantized: dict[str, tuple[str, tuple[int, ...]]] = {}
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, (dtype, shape) in inner.tensors.items():
            if not fp8.is_quantized(name, shape):
                tensors[name] = (dtype, shape)
                continue
            if dtype not in _FLOATS:
                raise CorruptSnapshot(f"{name} is {dtype}; FP8 quantizes {', '.join(_FLOATS)}")
            self.quantized[name] = (dtype, shape)
            tensors[name] = (fp8.FP8_DTYPE, shape)
            tensors[fp8.scale_name(name)] = (fp8.SCALE_DTYPE, fp8.scale_shape(shape))
        self.tensors: Mapping[str, tuple[str, tuple[int, ...]]] = tensors
        self._scales: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def pieces(self, region: Region) -> list[Piece]:
        weight = fp8.weight_name(region.source)
        if weight in self.quantized:
            size = _nbytes(self.tensors[region.source], region)
            return [Computed(size, lambda: self._scale_bytes(weight, region))]
        if region.source in self.quantized:
            size = _nbytes(self.tensors[region.source], region)
            return [Computed(size, lambda: self._fp8_bytes(region))]
        return self.inner.pieces(region)

    def whole_file(self, planned: PlannedFile) -> tuple[Path, tuple[TensorSpan, ...]] | None:
        return None  # the snapshot's files hold no FP8 weights

    def scales(self, weight: str) -> torch.Tensor:
        """The scales of ``weight``, computed on first use from one read of it."""
        with self._lock:
            if weight not in self._scales:
                rows = self.quantized[weight][1][0]
                self._scales[weight] = fp8.block_scales(self._read(RowRange(weight, 0, rows)))
            return self._scales[weight]

    def _scale_bytes(self, weight: str, region: Region) -> memoryview:
        return _bytes_of(_cut(self.scales(weight), region))

    def _fp8_bytes(self, region: Region) -> memoryview:
        scale = _cut(self.scales(region.source), _in_blocks(region))
        return _bytes_of(fp8.apply_scales(self._read(region), scale))

    def _read(self, region: Region) -> torch.Tensor:
        """The source's values in ``region`` (a 2-D tensor), read from ``inner``'s pieces."""
        import torch

        dtype, shape = self.quantized[region.source]
        data = bytearray(_nbytes((dtype, shape), region))
        at = 0
        for piece in self.inner.pieces(region):
            at += _read_piece(piece, memoryview(data)[at:])
        if at != len(data):
            raise SourceEnded(f"{region.source}: read {at} of {len(data)} bytes")
        rows = region.rows
        width = region.stop - region.start if isinstance(region, ColumnRange) else shape[1]
        values = torch.frombuffer(data, dtype=getattr(torch, TORCH_NAMES[dtype]))
        return values.view(rows, width)


def _in_blocks(region: Region) -> Region:
    """The scale blocks that cover ``region`` of a weight."""
    if isinstance(region, ColumnRange):
        first, stop = region.start // fp8.BLOCK, fp8.blocks(region.stop)
        return ColumnRange(region.source, first, stop, fp8.blocks(region.rows))
    return RowRange(region.source, region.start // fp8.BLOCK, fp8.blocks(region.stop))


def _cut(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    if isinstance(region, ColumnRange):
        return tensor[:, region.start : region.stop]
    return tensor[region.start : region.stop]


def _nbytes(entry: tuple[str, tuple[int, ...]], region: Region) -> int:
    dtype, shape = entry
    width = region.stop - region.start if isinstance(region, ColumnRange) else shape[1]
    return region.rows * width * DTYPE_SIZES[dtype]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    import torch

    flat = tensor.contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def _read_piece(piece: Piece, into: memoryview) -> int:
    """Copy ``piece``'s bytes to the start of ``into``; how many."""
    if isinstance(piece, FileRange):
        fd = os.open(piece.file, os.O_RDONLY)
        try:
            done = 0
            while done < piece.length:
                n = os.preadv(fd, [into[done : piece.length]], piece.offset + done)
                if n <= 0:
                    raise SourceEnded(f"{piece.file.name} ended {piece.length - done} bytes early")
                done += n
        finally:
            os.close(fd)
        return piece.length
    if isinstance(piece, Columns):
        fd = os.open(piece.file, os.O_RDONLY)
        try:
            rows = bytearray(piece.rows * piece.row_bytes)
            if os.preadv(fd, [rows], piece.offset) != len(rows):
                raise SourceEnded(f"{piece.file.name} ended early")
        finally:
            os.close(fd)
        table = np.frombuffer(rows, np.uint8).reshape(piece.rows, piece.row_bytes)
        out = np.frombuffer(into, np.uint8, count=piece.rows * piece.length)
        columns = table[:, piece.start : piece.start + piece.length]
        out.reshape(piece.rows, piece.length)[:] = columns
        return piece.rows * piece.length
    if isinstance(piece, Computed):
        data = piece.make().cast("B")
        into[: len(data)] = data
        return len(data)
    data = piece.cast("B")
    into[: len(data)] = data
    return len(data)
