"""Write a safetensors file by copying byte ranges, never holding the tensors in memory.

The header is built the way ``safetensors.torch.save_file`` builds it (tensors ordered by
dtype, widest alignment first, then by name; compact JSON; padded with spaces to 8 bytes), so
a file written here is byte for byte the file ``save_file`` writes for the same tensors.
Data comes from :class:`FileRange` pieces (copied in the kernel with ``copy_file_range``),
:class:`Columns` pieces (a column block of a row-major matrix, gathered through one reused
buffer) or bytes already in memory. A second thread hashes the file as it grows, so the
sha256 the manifest needs costs no extra pass; the caller fsyncs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

BUFFER_BYTES = 16 * 1024 * 1024

_DTYPE_NAMES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
_DTYPE_ORDER = {name: i for i, name in enumerate(_DTYPE_NAMES.values())}
"""safetensors' ``Dtype`` enum order; ``save_file`` writes the widest (last) first."""

_NO_COPY_FILE_RANGE = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


class SourceEnded(OSError):
    """A source file ended before a piece it should hold (a snapshot truncated under us)."""


@dataclass(frozen=True)
class FileRange:
    """``length`` bytes at ``offset`` of ``file``."""

    file: Path
    offset: int
    length: int


@dataclass(frozen=True)
class Columns:
    """Bytes ``[start, start + length)`` of each of ``rows`` rows of ``row_bytes`` at ``offset``."""

    file: Path
    offset: int
    rows: int
    row_bytes: int
    start: int
    length: int


Piece = FileRange | Columns | memoryview


@dataclass(frozen=True)
class OutputTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Written:
    bytes: int
    sha256: str


def piece_bytes(piece: Piece) -> int:
    if isinstance(piece, FileRange):
        return piece.length
    if isinstance(piece, Columns):
        return piece.rows * piece.length
    return piece.nbytes


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"safetensors cannot hold {dtype}") from None


def file_order(tensors: Iterable[OutputTensor]) -> list[OutputTensor]:
    """The order ``save_file`` lays tensors out in: widest dtype first, then by name."""
    return sorted(tensors, key=lambda t: (-_DTYPE_ORDER[dtype_name(t.dtype)], t.name))


def header(tensors: Sequence[OutputTensor], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and JSON header for ``tensors`` already in :func:`file_order`."""
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in tensors:
        entries[t.name] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    path: Path, tensors: Iterable[OutputTensor], metadata: Mapping[str, str]
) -> Written:
    """Write ``tensors`` to a new file at ``path``; returns its size and sha256 (not fsynced)."""
    ordered = file_order(tensors)
    for t in ordered:
        got = sum(piece_bytes(p) for p in t.pieces)
        if got != t.nbytes:
            raise ValueError(f"{t.name}: pieces hold {got} bytes, shape {t.shape} needs {t.nbytes}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        hasher = _TrailingHasher(path)
        with _Copier(fd, hasher) as copier:
            copier.write(memoryview(header(ordered, metadata)))
            for t in ordered:
                for piece in t.pieces:
                    copier.copy(piece)
        return Written(copier.position, hasher.hexdigest())
    finally:
        os.close(fd)


class _TrailingHasher(threading.Thread):
    """Hashes ``path`` from the start up to the writer's position, following it as it grows."""

    def __init__(self, path: Path) -> None:
        super().__init__(name="weightcast-hash", daemon=True)
        self.path = path
        self.digest = hashlib.sha256()
        self.cond = threading.Condition()
        self.available = 0
        self.finished = False
        self.error: BaseException | None = None

    def advance(self, position: int, finished: bool = False) -> None:
        with self.cond:
            self.available, self.finished = position, finished
            self.cond.notify()

    def run(self) -> None:
        buffer = bytearray(BUFFER_BYTES)
        view = memoryview(buffer)
        done = 0
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                while True:
                    with self.cond:
                        while self.available == done and not self.finished:
                            self.cond.wait()
                        limit, finished = self.available, self.finished
                    while done < limit:
                        n = os.preadv(fd, [view[: min(BUFFER_BYTES, limit - done)]], done)
                        if n <= 0:
                            raise OSError(f"{self.path}: short read while hashing at {done}")
                        self.digest.update(view[:n])
                        done += n
                    if finished and done == limit:
                        return
            finally:
                os.close(fd)
        except BaseException as exc:  # reported to the writer thread by hexdigest()
            self.error = exc

    def hexdigest(self) -> str:
        self.join()
        if self.error is not None:
            raise self.error
        return self.digest.hexdigest()


class _Copier:
    """Appends pieces to ``fd``; one reused buffer, source files opened once each."""

    def __init__(self, fd: int, hasher: _TrailingHasher) -> None:
        self.fd = fd
        self.hasher = hasher
        self.position = 0
        self.sources: dict[Path, int] = {}
        self.kernel_copy = True
        self._buffer: memoryview | None = None

    def __enter__(self) -> _Copier:
        self.hasher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hasher.advance(self.position, finished=True)
        for source in self.sources.values():
            os.close(source)
        if exc[0] is not None:
            self.hasher.join()

    @property
    def buffer(self) -> memoryview:
        if self._buffer is None:
            self._buffer = memoryview(bytearray(BUFFER_BYTES))
        return self._buffer

    def copy(self, piece: Piece) -> None:
        if isinstance(piece, FileRange):
            self._copy_range(self._source(piece.file), piece.offset, piece.length)
        elif isinstance(piece, Columns):
            self._copy_columns(piece)
        else:
            self.write(piece.cast("B"))

    def write(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            done += os.write(self.fd, data[done:])
        self._advanced(len(data))

    def _source(self, file: Path) -> int:
        if file not in self.sources:
            self.sources[file] = os.open(file, os.O_RDONLY)
        return self.sources[file]

    def _advanced(self, n: int) -> None:
        self.position += n
        self.hasher.advance(self.position)

    def _copy_range(self, source: int, offset: int, length: int) -> None:
        end = offset + length
        while offset < end:
            step = min(end - offset, 256 * 1024 * 1024)
            n = self._copy_step(source, offset, step)
            if n == 0:
                raise SourceEnded(errno.EIO, f"source ended {end - offset} bytes early")
            offset += n
            self._advanced(n)

    def _copy_step(self, source: int, offset: int, length: int) -> int:
        if self.kernel_copy:
            try:
                return os.copy_file_range(source, self.fd, length, offset)
            except OSError as exc:
                if exc.errno not in _NO_COPY_FILE_RANGE:
                    raise
                self.kernel_copy = False
        view = self.buffer[: min(length, BUFFER_BYTES)]
        n = os.preadv(source, [view], offset)
        done = 0
        while done < n:
            done += os.write(self.fd, view[done:n])
        return n

    def _copy_columns(self, piece: Columns) -> None:
        source = self._source(piece.file)
        if piece.row_bytes + piece.length > BUFFER_BYTES:
            raise ValueError(f"rows of {piece.row_bytes} bytes do not fit the copy buffer")
        rows_per_read = max(1, BUFFER_BYTES // (piece.row_bytes + piece.length))
        out_room = rows_per_read * piece.length
        for first in range(0, piece.rows, rows_per_read):
            count = min(rows_per_read, piece.rows - first)
            block = self.buffer[: count * piece.row_bytes]
            n = os.preadv(source, [block], piece.offset + first * piece.row_bytes)
            if n != len(block):
                raise SourceEnded(errno.EIO, f"short read of {piece.file}")
            out_start = BUFFER_BYTES - out_room
            out = self.buffer[out_start : out_start + count * piece.length]
            for i in range(count):
                src = i * piece.row_bytes + piece.start
                out[i * piece.length : (i + 1) * piece.length] = block[src : src + piece.length]
            self.write(out)
