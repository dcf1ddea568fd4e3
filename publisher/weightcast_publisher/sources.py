"""Where the bytes of a snapshot's tensors are: the source a version is written from.

A ``dcp-safetensors`` snapshot is read from its files' headers alone
(:class:`HeaderSource`): each file lists its tensors' blocks of rows and their byte offsets,
and ``DCP_SHARDING_INFO`` says where each block starts in the full tensor. Nothing is
loaded and nothing is unpickled; the writer copies byte ranges. The blocks of every tensor
must tile it exactly: a gap or an overlap is a corrupt snapshot, never silently loaded.

Everything else (``dcp-torchsave`` snapshots, blocks that are not whole rows, or
``--reader dcp-load``) is loaded with ``dcp.load`` (:mod:`weightcast_publisher.dcp_load`,
the only part of the publish path that needs torch) and written from memory.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from weightcast.contract.errors import LayoutError, WeightcastError
from weightcast.contract.plan import PlannedFile
from weightcast.contract.regions import ColumnRange, Region, RowRange
from weightcast.contract.snapshot_format import FORMAT_DCP_SAFETENSORS, SHARDING_INFO_KEY
from weightcast.contract.tensorfile import DTYPE_SIZES, HeaderError, TensorSpan, read_header
from weightcast_publisher.safetensors_writer import Columns, FileRange, Piece
from weightcast_publisher.settings import READERS
from weightcast_publisher.snapshot_scan import CorruptSnapshot, Snapshot

READER_AUTO, READER_DCP_LOAD = READERS
BYTE_RANGE = "byte-range"


class Unsupported(WeightcastError):
    """A valid snapshot whose blocks are not whole rows: read it with ``dcp.load``."""


class Source(Protocol):
    kind: str
    """How the bytes are read: ``byte-range`` or ``dcp-load`` (a metrics label)."""
    tensors: Mapping[str, tuple[str, tuple[int, ...]]]
    """Tensor name -> (safetensors dtype, full shape)."""

    def pieces(self, region: Region) -> list[Piece]: ...

    def whole_file(self, planned: PlannedFile) -> tuple[Path, tuple[TensorSpan, ...]] | None:
        """The snapshot file that already is ``planned`` (to link), and its tensors."""
        ...


@dataclass(frozen=True)
class Chunk:
    """Rows ``[row_start, row_stop)`` of a tensor, row-major at ``offset`` in ``file``."""

    file: Path
    offset: int
    row_start: int
    row_stop: int


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * DTYPE_SIZES[self.dtype]


def open_source(snapshot: Snapshot, reader: str = READER_AUTO) -> Source:
    """Byte ranges from the headers when the snapshot allows, else its tensors loaded."""
    if reader not in READERS:
        raise LayoutError(f"unknown reader {reader!r}; choose one of {', '.join(READERS)}")
    if reader == READER_AUTO and snapshot.info.format == FORMAT_DCP_SAFETENSORS:
        try:
            return HeaderSource(snapshot)
        except Unsupported:
            pass
    from weightcast_publisher.dcp_load import MemorySource

    return MemorySource(snapshot)


class HeaderSource:
    """Byte ranges inside a ``dcp-safetensors`` snapshot's files, from their headers."""

    kind = BYTE_RANGE

    def __init__(self, snapshot: Snapshot) -> None:
        self.headers: dict[Path, tuple[TensorSpan, ...]] = {}
        parts: dict[str, list[tuple[TensorSpan, int, Path]]] = {}
        for entry in snapshot.info.files:
            path = snapshot.path / entry.name
            spans, offsets = _read_file(path)
            self.headers[path] = spans
            for span in spans:
                parts.setdefault(span.name, []).append((span, offsets[span.name], path))
        self.index = {name: _tile(name, blocks) for name, blocks in parts.items()}
        self.tensors = {name: (t.dtype, t.shape) for name, t in self.index.items()}

    def pieces(self, region: Region) -> list[Piece]:
        tensor = self.index[region.source]
        if isinstance(region, ColumnRange):
            item = DTYPE_SIZES[tensor.dtype]
            return [
                Columns(
                    c.file,
                    c.offset,
                    c.row_stop - c.row_start,
                    tensor.row_bytes,
                    region.start * item,
                    (region.stop - region.start) * item,
                )
                for c in tensor.chunks
            ]
        pieces: list[Piece] = []
        for chunk in tensor.chunks:
            lo, hi = max(region.start, chunk.row_start), min(region.stop, chunk.row_stop)
            if lo < hi:
                offset = chunk.offset + (lo - chunk.row_start) * tensor.row_bytes
                pieces.append(FileRange(chunk.file, offset, (hi - lo) * tensor.row_bytes))
        return _merge(pieces)

    def whole_file(self, planned: PlannedFile) -> tuple[Path, tuple[TensorSpan, ...]] | None:
        """The one data file, if it holds exactly ``planned``'s tensors, whole (one rank)."""
        if len(self.headers) != 1:
            return None
        path, spans = next(iter(self.headers.items()))
        held = {s.name: (s.dtype, s.shape) for s in spans}
        wanted = {t.name: (t.dtype, t.shape) for t in planned.tensors}
        whole = all(
            t.regions == (RowRange(t.name, 0, t.shape[0] if t.shape else 1),)
            for t in planned.tensors
        )
        aligned = all(s.start % DTYPE_SIZES[s.dtype] == 0 for s in spans)
        return (path, spans) if whole and aligned and held == wanted else None


def _read_file(path: Path) -> tuple[tuple[TensorSpan, ...], dict[str, tuple[int, ...]]]:
    """A data file's tensors and where each block starts in its full tensor."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CorruptSnapshot(f"{path.name} unreadable: {exc}") from None
    try:
        header = read_header(fd, path.name)
    except HeaderError as exc:
        raise CorruptSnapshot(str(exc)) from None
    finally:
        os.close(fd)
    raw = header.metadata.get(SHARDING_INFO_KEY)
    try:
        info = json.loads(raw) if raw is not None else {}
        offsets = {
            s.name: tuple(info[s.name]["saved_offsets"]) if raw is not None else (0,) * len(s.shape)
            for s in header.tensors
        }
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptSnapshot(f"{path.name}: {SHARDING_INFO_KEY} unreadable: {exc!r}") from None
    for span in header.tensors:
        where = offsets[span.name]
        if len(where) != len(span.shape) or not all(type(o) is int and o >= 0 for o in where):
            raise CorruptSnapshot(f"{path.name}: {span.name} has offsets {list(where)}")
        if any(where[1:]):
            raise Unsupported(f"{span.name}: a block at {list(where)} is not whole rows")
    return header.tensors, offsets


def _tile(name: str, blocks: Sequence[tuple[TensorSpan, tuple[int, ...], Path]]) -> SourceTensor:
    """One tensor from its blocks, which must cover its rows exactly once."""
    dtypes = {span.dtype for span, _, _ in blocks}
    trailing = {span.shape[1:] for span, _, _ in blocks}
    ranks = {len(span.shape) for span, _, _ in blocks}
    if len(dtypes) != 1 or len(trailing) != 1 or len(ranks) != 1:
        raise CorruptSnapshot(f"{name}: its blocks disagree on dtype or shape")
    dtype = dtypes.pop()
    if ranks.pop() == 0:
        if len(blocks) != 1:
            raise CorruptSnapshot(f"{name}: a scalar stored {len(blocks)} times")
        span, _, path = blocks[0]
        return SourceTensor(name, dtype, (), (Chunk(path, span.start, 0, 1),))
    chunks = sorted(
        (
            Chunk(path, span.start, where[0], where[0] + span.shape[0])
            for span, where, path in blocks
            if span.shape[0]
        ),
        key=lambda c: c.row_start,
    )
    at = 0
    for chunk in chunks:
        if chunk.row_start != at:
            what = "overlap" if chunk.row_start < at else "leave a gap"
            raise CorruptSnapshot(f"{name}: its blocks {what} at row {min(at, chunk.row_start)}")
        at = chunk.row_stop
    return SourceTensor(name, dtype, (at, *trailing.pop()), tuple(chunks))


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
