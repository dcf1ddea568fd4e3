"""Write a safetensors file by copying byte ranges, never holding the tensors in memory.

The header is built the way ``safetensors.torch.save_file`` builds it (tensors ordered by
dtype, widest alignment first, then by name; compact JSON; padded with spaces to 8 bytes), so
a file written here is byte for byte the file ``save_file`` writes for the same tensors.

Data comes from :class:`FileRange` pieces (byte ranges of the snapshot's files),
:class:`Columns` pieces (a column block of a row-major matrix, for per-rank files) or bytes
already in memory. They are gathered into a few reused, page-aligned buffers: the calling
thread fills one, a hash thread hashes the one before (the manifest's sha256 costs no extra
pass) and a writer thread writes an earlier one with ``O_DIRECT``, so reading, hashing and
the disk overlap and the page cache is neither filled nor flushed. Filesystems without
``O_DIRECT`` (tmpfs) get ordinary writes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import mmap
import os
import queue
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from weightcast.contract.manifest import FileEntry

BUFFER_BYTES = 16 * 1024 * 1024
BUFFERS = 4
_ALIGN = 4096

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
) -> FileEntry:
    """Write ``tensors`` to a new file at ``path`` and fsync it; returns its manifest entry."""
    ordered = file_order(tensors)
    for t in ordered:
        got = sum(piece_bytes(p) for p in t.pieces)
        if got != t.nbytes:
            raise ValueError(f"{t.name}: pieces hold {got} bytes, shape {t.shape} needs {t.nbytes}")
    with _PipelinedWriter(path) as writer:
        writer.append(memoryview(header(ordered, metadata)))
        for t in ordered:
            for piece in t.pieces:
                writer.copy(piece)
    return FileEntry(path.name, writer.size, writer.digest.hexdigest())


class _PipelinedWriter:
    """Fill here, hash in one thread, write in another: a ring of aligned buffers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.digest = hashlib.sha256()
        self.size = 0
        self.buffers = [mmap.mmap(-1, BUFFER_BYTES) for _ in range(BUFFERS)]
        self.free: queue.Queue[int] = queue.Queue()
        self.full: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self.hashed: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self.sources: dict[Path, int] = {}
        self.error: BaseException | None = None
        self._scratch: memoryview | None = None
        self.fd, self.direct = _open_output(path)
        for i in range(BUFFERS):
            self.free.put(i)
        self.current = self.free.get()
        self.filled = 0
        self.threads = [
            threading.Thread(target=self._hash_loop, name="weightcast-hash"),
            threading.Thread(target=self._write_loop, name="weightcast-writer"),
        ]

    def __enter__(self) -> _PipelinedWriter:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None:
                self._hand_over()
            self.full.put(None)
            for thread in self.threads:
                thread.join()
            if exc_type is None:
                if self.error is not None:
                    raise self.error
                os.ftruncate(self.fd, self.size)  # drop the padding of the last direct write
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            for fd in self.sources.values():
                os.close(fd)
            for buffer in self.buffers:
                buffer.close()

    def copy(self, piece: Piece) -> None:
        if isinstance(piece, FileRange):
            self._read_range(self._source(piece.file), piece.offset, piece.length)
        elif isinstance(piece, Columns):
            self._copy_columns(piece)
        else:
            self.append(piece.cast("B"))

    def append(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            n = min(len(data) - done, BUFFER_BYTES - self.filled)
            view = memoryview(self.buffers[self.current])
            view[self.filled : self.filled + n] = data[done : done + n]
            view.release()
            self._filled(n)
            done += n

    def _read_range(self, source: int, offset: int, length: int) -> None:
        end = offset + length
        while offset < end:
            room = min(end - offset, BUFFER_BYTES - self.filled)
            view = memoryview(self.buffers[self.current])
            try:
                n = os.preadv(source, [view[self.filled : self.filled + room]], offset)
            finally:
                view.release()
            if n <= 0:
                raise SourceEnded(errno.EIO, f"source ended {end - offset} bytes early")
            offset += n
            self._filled(n)

    def _copy_columns(self, piece: Columns) -> None:
        source = self._source(piece.file)
        if piece.row_bytes > BUFFER_BYTES:
            raise ValueError(f"rows of {piece.row_bytes} bytes do not fit the copy buffer")
        if self._scratch is None:
            self._scratch = memoryview(bytearray(BUFFER_BYTES))
        rows_per_read = BUFFER_BYTES // piece.row_bytes
        for first in range(0, piece.rows, rows_per_read):
            count = min(rows_per_read, piece.rows - first)
            block = self._scratch[: count * piece.row_bytes]
            if os.preadv(source, [block], piece.offset + first * piece.row_bytes) != len(block):
                raise SourceEnded(errno.EIO, f"short read of {piece.file}")
            for i in range(count):
                start = i * piece.row_bytes + piece.start
                self.append(block[start : start + piece.length])

    def _filled(self, n: int) -> None:
        self.filled += n
        self.size += n
        if self.filled == BUFFER_BYTES:
            self._hand_over()
            self.current = self._next_free()
            self.filled = 0

    def _hand_over(self) -> None:
        self.full.put((self.current, self.filled))

    def _next_free(self) -> int:
        while True:
            try:
                return self.free.get(timeout=1)
            except queue.Empty:
                if self.error is not None or not all(t.is_alive() for t in self.threads):
                    raise self.error or OSError(errno.EIO, "a writer thread died") from None

    def _source(self, file: Path) -> int:
        if file not in self.sources:
            self.sources[file] = os.open(file, os.O_RDONLY)
        return self.sources[file]

    def _hash_loop(self) -> None:
        """Hash buffers in file order (before the writer may pad them), pass them on."""
        while (item := self.full.get()) is not None:
            index, n = item
            view = memoryview(self.buffers[index])
            self.digest.update(view[:n])
            view.release()
            self.hashed.put(item)
        self.hashed.put(None)

    def _write_loop(self) -> None:
        while (item := self.hashed.get()) is not None:
            index, n = item
            try:
                if self.error is None:
                    self._write(memoryview(self.buffers[index]), n)
            except BaseException as exc:  # handed to the filling thread
                self.error = exc
            self.free.put(index)

    def _write(self, view: memoryview, n: int) -> None:
        if self.direct and n % _ALIGN:
            view[n : n + (-n % _ALIGN)] = bytes(-n % _ALIGN)  # padding, truncated at the end
            n += -n % _ALIGN
        done = 0
        try:
            while done < n:
                done += os.write(self.fd, view[done:n])
        except OSError as exc:
            if not self.direct or exc.errno != errno.EINVAL:
                raise
            self._drop_direct()
            while done < n:
                done += os.write(self.fd, view[done:n])
        finally:
            view.release()

    def _drop_direct(self) -> None:
        """A filesystem that accepted O_DIRECT at open but not for this write: go buffered."""
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False


def _open_output(path: Path) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644), True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return os.open(path, flags, 0o644), False
