"""Write a safetensors file by copying byte ranges; digest and check it on the way.

The header is built the way ``safetensors.torch.save_file`` builds it
(:mod:`weightcast.contract.tensorfile`), so a file written here is byte for byte the file
``save_file`` writes for the same tensors. Data comes from :class:`FileRange` pieces (byte
ranges of the snapshot's files), :class:`Columns` pieces (a column block of a row-major
matrix, for per-rank files) or bytes already in memory (the ``dcp.load`` fallback).

Blocks (:func:`block_lengths`) are at most 4 MiB and never cross a 16 MiB buffer boundary;
where a tensor-parallel rank reads only its own rows of a tensor (:attr:`OutputTensor.ranks`),
they are also cut wherever the set of ranks that read the bytes changes, so that each rank
reads and verifies its own bytes and not its neighbours' (a fixed 4 MiB grid made tp 8 ranks
of a 0.6B model read 1.6-2.2x their bytes).

Pieces are gathered into a ring of page-aligned 16 MiB buffers. The calling thread fills
them in file order; hash threads take each full buffer, compute the manifest's per-block
digests of the blocks it holds (no block crosses a buffer boundary, so buffers hash
independently and in parallel) and check every float tensor's bytes in it for NaN and
infinity; then every :class:`BufferSink` of the file takes it. Reading, hashing, checking
and the sinks overlap, every byte is touched once, and memory stays at the ring's size
whatever the model's.

The sinks are what a buffer is for, each behind the same small interface: the file on disk
(:class:`DiskFile`, ``O_DIRECT`` at the buffer's offset; ordinary writes on filesystems
without it, such as tmpfs), its copy in the object store (:class:`UploadParts`, one part a
buffer: no second pass over the file) and the version's delta
(:mod:`weightcast_publisher.delta_writer`). The pipeline knows only whether a sink is
``optional``. The others run in one writer thread, in their order, and an error of theirs
fails the write. An optional one runs in the hash thread that checked the buffer, after the
buffer went to the writer, so its work overlaps the disk; it must not raise, and it must not
hold the writer for long: while the filling thread waits for a free buffer and the writer is
done with one an optional sink still holds, the pipeline tells that sink how long it has
waited so far (``behind``), and the sink decides whether to give up (the delta is dropped,
the buffers come free) or to let the write wait on. Only those waits count (not, say, the
writer idle while both hash threads encode): a file of fewer buffers than the ring, and the
last buffers of any file, always end with the writer waiting on them for a moment, which
costs the publish little. A buffer is free again once every sink is done with it.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import itertools
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from weightcast.contract.errors import WeightcastError
from weightcast.contract.manifest import BLOCK_BYTES, BlockDigests, FileEntry, new_hasher
from weightcast.contract.tensorfile import (
    DTYPE_SIZES,
    NON_FINITE,
    TensorSpan,
    encode_header,
    file_order,
)
from weightcast.store.base import PartUpload

BUFFER_BYTES = 16 * 1024 * 1024
HASH_THREADS = max(2, min(12, len(os.sched_getaffinity(0))))
"""Threads that digest, check and encode the delta of the buffers: one per core this process
may run on (the encoding is a version's costliest work besides the disk, and numpy and zstd
release the GIL), at least two so that the disk and the digests overlap on one core."""
BUFFERS = HASH_THREADS + 4
"""The ring: a buffer for each hash thread, one filling, one or two at the disk, one spare
(6 on two cores, as before the thread count followed the cores)."""
BEHIND_SLICE = 0.005
"""Seconds between two reports to the sink of a wait it causes."""
_ALIGN = 4096
_CHECK_BYTES = 1024 * 1024
"""The finiteness check works through a buffer in slices this size (they stay in cache)."""
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_METADATA = {"format": "pt"}
assert BUFFER_BYTES % BLOCK_BYTES == 0 and BUFFER_BYTES % _ALIGN == 0


class BufferSink(Protocol):
    """What takes each buffer of a file once its blocks are digested and its floats checked."""

    optional: bool
    """False: the write needs it (it runs in the writer thread; an error fails the write).
    True: it rides along (it runs in a hash thread, must not raise, is told when it holds
    the write: :meth:`behind`)."""

    def take(self, offset: int, data: memoryview, blocks: range, digests: Sequence[str]) -> None:
        """``data`` (file offset ``offset``) holds ``blocks`` whole, their new ``digests``
        filled in; buffers in any order (an optional sink's from several threads at once);
        ``data`` is the ring's, reused once this returns."""

    def behind(self, seconds: float) -> None:
        """An optional sink: the ring has waited ``seconds`` more on it (the writer is done
        with a buffer this sink still holds): give up (and return from :meth:`take` at once
        from then on) or let it wait. Called again every :data:`BEHIND_SLICE` of a wait."""


class FileSinks(Protocol):
    """Who gives an optional :class:`BufferSink` per file (the version's delta)."""

    def file(self, name: str, size: int, blocks: BlockDigests) -> BufferSink | None:
        """The sink of file ``name`` (``size`` bytes cut into ``blocks``), or None."""


class DiskFile:
    """The file on disk: each buffer written at its offset, with ``O_DIRECT`` where the
    filesystem takes it (:func:`_open_output`). ``O_DIRECT`` writes whole 4 KiB pages, so
    the file's last, short buffer is written padded with zeros from the rest of its ring
    buffer (``data`` always starts one) and the file truncated to its size afterwards."""

    optional = False

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd, self.direct = fd, direct

    def take(self, offset: int, data: memoryview, blocks: range, digests: Sequence[str]) -> None:
        n = len(data)
        if not self.direct or n % _ALIGN == 0:
            self._write(data, offset)
            return
        # The last buffer: padded, truncated at the end. Every view is released on the way
        # out, an error's too (a traceback that kept one would stop the ring from closing).
        with memoryview(data.obj) as whole, whole[: n + (-n % _ALIGN)] as padded:  # type: ignore[arg-type]
            padded[n:] = bytes(len(padded) - n)
            self._write(padded, offset)

    def _write(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(self.fd, view[done:], offset + done)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                self._drop_direct()

    def behind(self, seconds: float) -> None:
        raise AssertionError("the disk file is not optional")

    def _drop_direct(self) -> None:
        """A filesystem that accepted O_DIRECT at open but not for this write: go buffered."""
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        self.direct = False


class UploadParts:
    """The file's copy in the object store: each buffer one part of the upload."""

    optional = False

    def __init__(self, upload: PartUpload) -> None:
        self.upload = upload

    def take(self, offset: int, data: memoryview, blocks: range, digests: Sequence[str]) -> None:
        self.upload.part(offset // BUFFER_BYTES + 1, data)

    def behind(self, seconds: float) -> None:
        raise AssertionError("the upload is not optional")


class SourceEnded(WeightcastError, OSError):
    """A source file ended before a piece it should hold (a snapshot truncated under us)."""


class NonFiniteTensor(WeightcastError, ValueError):
    """A float tensor holds NaN or infinity; the message names it."""


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


@dataclass(frozen=True)
class Computed:
    """``length`` bytes that ``make`` computes when the writer reaches them (quantized
    weights), so that only the piece being written is ever in memory."""

    length: int
    make: Callable[[], memoryview]


Piece = FileRange | Columns | Computed | memoryview


@dataclass(frozen=True)
class OutputTensor:
    """A tensor to write: safetensors dtype, shape, and the pieces its bytes come from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    ranks: tuple[tuple[int, int], ...] = ()
    """Byte ranges of the tensor (from its first byte) that each tensor-parallel rank reads,
    by rank, when ranks read only their own rows; empty when every reader reads all of it."""

    @property
    def nbytes(self) -> int:
        size = DTYPE_SIZES[self.dtype]
        for dim in self.shape:
            size *= dim
        return size


def piece_bytes(piece: Piece) -> int:
    if isinstance(piece, FileRange):
        return piece.length
    if isinstance(piece, Columns):
        return piece.rows * piece.length
    if isinstance(piece, Computed):
        return piece.length
    return piece.nbytes


def write_safetensors(
    path: Path,
    tensors: Sequence[OutputTensor],
    digest: str,
    name: str | None = None,
    sinks: FileSinks | None = None,
    upload: PartUpload | None = None,
) -> FileEntry:
    """Write ``tensors`` to a new file at ``path``, fsync it; its manifest entry (``name``,
    default the file's name), each of its buffers also handed to ``sinks``' sink for it and,
    once written, sent as a part of ``upload`` (the object store's copy: no second pass
    over the file). Raises :class:`NonFiniteTensor` for a NaN or infinity."""
    ordered = {t.name: t for t in tensors}
    order = [ordered[n] for n, _ in file_order((t.name, t.dtype) for t in tensors)]
    for t in order:
        got = sum(piece_bytes(p) for p in t.pieces)
        if got != t.nbytes:
            need = f"{t.dtype} {t.shape} needs {t.nbytes}"
            raise ValueError(f"{t.name}: pieces hold {got} bytes, {need}")
    header = encode_header([(t.name, t.dtype, t.shape) for t in order], _METADATA)
    spans, at = [], len(header)
    readers: list[tuple[int, int, object]] = [(0, at, _EVERY_READER)]
    for t in order:
        spans.append(TensorSpan(t.name, t.dtype, t.shape, at, at + t.nbytes))
        readers += _readers(at, t)
        at += t.nbytes
    blocks = _blocks(at, digest, block_lengths(at, readers))
    fd, direct = _open_output(path)
    try:
        written: list[BufferSink] = [DiskFile(fd, direct)]
        if upload is not None:
            written.append(UploadParts(upload))
        with _Pipeline(
            at, spans, blocks, _sinks(written, sinks, name or path.name, at, blocks)
        ) as pipeline:
            pipeline.append(memoryview(header))
            for t in order:
                for piece in t.pieces:
                    pipeline.copy(piece)
        os.ftruncate(fd, at)  # drop the padding of the last direct write
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileEntry(name or path.name, at, blocks=blocks)


def _blocks(size: int, digest: str, lengths: list[int] | None) -> BlockDigests:
    """A file's blocks, their digests to be filled in by the pipeline."""
    count = -(-size // BLOCK_BYTES) if lengths is None else len(lengths)
    return BlockDigests(digest, BLOCK_BYTES, [""] * count, lengths)


def _sinks(
    sinks: list[BufferSink], more: FileSinks | None, name: str, size: int, blocks: BlockDigests
) -> list[BufferSink]:
    """``sinks``, and ``more``'s for file ``name`` (``size`` bytes) when it has one."""
    extra = more.file(name, size, blocks) if more is not None else None
    return sinks if extra is None else [*sinks, extra]


_EVERY_READER = "every reader"


def _readers(offset: int, tensor: OutputTensor) -> list[tuple[int, int, object]]:
    """Who reads each byte of ``tensor`` (at ``offset`` in the file): (start, stop, the
    ranks), from the boundaries of the ranks' ranges."""
    if not tensor.nbytes:
        return []
    if not tensor.ranks:
        return [(offset, offset + tensor.nbytes, _EVERY_READER)]
    edges = sorted({0, tensor.nbytes, *(x for r in tensor.ranks for x in r)})
    runs: list[tuple[int, int, object]] = []
    for lo, hi in itertools.pairwise(edges):
        ranks = frozenset(i for i, (a, b) in enumerate(tensor.ranks) if a <= lo and hi <= b)
        runs.append((offset + lo, offset + hi, ranks))
    return runs


def block_lengths(size: int, readers: Sequence[tuple[int, int, object]]) -> list[int] | None:
    """The digest blocks of a ``size``-byte file: cut at every multiple of BUFFER_BYTES and
    wherever the readers change (``readers``: (start, stop, who reads it) in file order,
    covering the file), then into pieces of at most BLOCK_BYTES. None when that is just the
    fixed grid of BLOCK_BYTES blocks (the manifest then lists no lengths)."""
    cuts = set(range(0, size, BUFFER_BYTES)) | {size}
    for (_, stop, before), (start, _, after) in itertools.pairwise(readers):
        assert stop == start, "readers must cover the file in order"
        if before != after:
            cuts.add(start)
    lengths = []
    edges = sorted(cuts)
    for lo, hi in itertools.pairwise(edges):
        lengths += [min(BLOCK_BYTES, hi - at) for at in range(lo, hi, BLOCK_BYTES)]
    fixed = [min(BLOCK_BYTES, size - at) for at in range(0, size, BLOCK_BYTES)]
    return None if lengths == fixed else lengths


def digest_file(
    path: Path,
    spans: Sequence[TensorSpan],
    digest: str,
    name: str,
    sinks: FileSinks | None = None,
) -> FileEntry:
    """The manifest entry of an existing file (one read), its float ``spans`` checked, its
    buffers handed to ``sinks``' sink for it."""
    size = os.path.getsize(path)
    blocks = _blocks(size, digest, None)
    with _Pipeline(size, spans, blocks, _sinks([], sinks, name, size, blocks)) as pipeline:
        pipeline.copy(FileRange(path, 0, size))
    return FileEntry(name, size, blocks=blocks)


def link_file(source: Path, target: Path) -> str:
    """Make ``target`` the same bytes as ``source`` without copying them, if the filesystem
    can: a reflink (its own inode, copy-on-write) or a hard link. Returns how, or "" when
    neither works (another filesystem, no link support) and the caller must copy."""
    with contextlib.suppress(OSError):
        with open(source, "rb") as src, open(target, "xb") as dst:
            fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
            os.fsync(dst.fileno())
        return "reflink"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(target)
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
            return ""
        raise
    return "link"


_FICLONE = 0x40049409
"""``ioctl(dest, FICLONE, src)``: share the source's extents (btrfs, XFS, bcachefs)."""


class _Pipeline:
    """Fill here; hash and check in ``HASH_THREADS`` threads, which then hand each buffer to
    the optional sinks; the other sinks in one writer thread."""

    def __init__(
        self,
        size: int,
        spans: Sequence[TensorSpan],
        blocks: BlockDigests,
        sinks: Sequence[BufferSink],
    ) -> None:
        self.size = size
        self.floats = [s for s in spans if s.dtype in NON_FINITE and s.stop > s.start]
        for span in self.floats:
            if span.start % DTYPE_SIZES[span.dtype]:
                raise ValueError(f"{span.name}: not aligned to its element size in the file")
        self.starts = [s.start for s in self.floats]
        self.blocks = blocks
        """Where each block is; its digests are filled in as buffers are hashed."""
        self.needed = [sink for sink in sinks if not sink.optional]
        self.optional = [sink for sink in sinks if sink.optional]
        self.holders = 1 + len(self.optional)
        """Who must be done with a buffer before it is refilled: the writer thread (for the
        needed sinks), and each optional sink."""
        self.done = [0] * BUFFERS
        self.done_lock = threading.Lock()
        self.held: set[int] = set()
        """Buffers the writer is done with and an optional sink is not."""

        self.buffers = [mmap.mmap(-1, BUFFER_BYTES) for _ in range(BUFFERS)]
        self.free: queue.Queue[int] = queue.Queue()
        self.to_hash: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
        self.to_write: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
        self.sources: dict[Path, int] = {}
        self.error: BaseException | None = None
        self._scratch: memoryview | None = None
        for i in range(BUFFERS):
            self.free.put(i)
        self.current = self.free.get()
        self.filled = 0
        self.offset = 0  # of the current buffer in the file
        self.hashers = [
            threading.Thread(target=self._hash_loop, name=f"weightcast-hash-{i}")
            for i in range(HASH_THREADS)
        ]
        self.writer = threading.Thread(target=self._write_loop, name="weightcast-writer")

    def __enter__(self) -> _Pipeline:
        for thread in [*self.hashers, self.writer]:
            thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None and self.filled:
                self._hand_over()
            for _ in self.hashers:
                self.to_hash.put(None)
            for thread in self.hashers:
                thread.join()
            self.to_write.put(None)
            self.writer.join()
            if exc_type is None:
                if self.error is not None:
                    raise self.error
                if self.offset != self.size:
                    raise ValueError(f"wrote {self.offset} bytes, expected {self.size}")
        finally:
            for fd in self.sources.values():
                os.close(fd)
            for buffer in self.buffers:
                buffer.close()

    def copy(self, piece: Piece) -> None:
        if isinstance(piece, FileRange):
            self._read_range(self._source(piece.file), piece.offset, piece.length)
        elif isinstance(piece, Columns):
            self._copy_columns(piece)
        elif isinstance(piece, Computed):
            data = piece.make().cast("B")
            if len(data) != piece.length:
                raise ValueError(f"a computed piece of {piece.length} bytes made {len(data)}")
            self.append(data)
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
            rows = np.frombuffer(block, np.uint8).reshape(count, piece.row_bytes)
            self._append_rows(rows[:, piece.start : piece.start + piece.length])

    def _append_rows(self, rows: np.ndarray) -> None:
        """Append the rows of a strided 2-D byte array: as many as the buffer has room for
        in one strided copy (a column piece was once copied row by row: 1.59x cp + fsync for
        a Qwen3-30B-A3B at tp 4), a row that crosses the buffer's end on its own."""
        length = rows.shape[1]
        done = 0
        while done < len(rows):
            fit = min(len(rows) - done, (BUFFER_BYTES - self.filled) // length)
            if fit == 0:
                self.append(memoryview(np.ascontiguousarray(rows[done])))
                done += 1
                continue
            target = np.frombuffer(
                self.buffers[self.current], np.uint8, fit * length, self.filled
            ).reshape(fit, length)
            target[:] = rows[done : done + fit]
            del target  # no view of the buffer may outlive the copy (it is closed at the end)
            self._filled(fit * length)
            done += fit

    def _filled(self, n: int) -> None:
        self.filled += n
        if self.filled == BUFFER_BYTES:
            self._hand_over()
            self.current = self._next_free()

    def _hand_over(self) -> None:
        self.to_hash.put((self.current, self.offset, self.filled))
        self.offset += self.filled
        self.filled = 0

    def _next_free(self) -> int:
        """The next free buffer; a wait while an optional sink alone holds a buffer is
        reported to the optional sinks, slice by slice (the last, shorter one too)."""
        with contextlib.suppress(queue.Empty):
            return self.free.get_nowait()
        waited = 0.0
        while True:
            if self.error is not None:
                raise self.error
            with self.done_lock:
                behind = bool(self.held)
            start = time.monotonic()
            try:
                index: int | None = self.free.get(timeout=BEHIND_SLICE)
            except queue.Empty:
                index = None
            if behind:  # the wait is an optional sink's
                for sink in self.optional:
                    sink.behind(time.monotonic() - start)
            if index is not None:
                return index
            waited += BEHIND_SLICE
            if waited >= 1 and not all(t.is_alive() for t in [*self.hashers, self.writer]):
                raise OSError(errno.EIO, "a writer thread died")

    def _source(self, file: Path) -> int:
        if file not in self.sources:
            self.sources[file] = os.open(file, os.O_RDONLY)
        return self.sources[file]

    def _hash_loop(self) -> None:
        """Digest the blocks of each buffer and check its floats, then pass it on: to the
        writer, then to each optional sink."""
        scratch = np.empty(_CHECK_BYTES, dtype=np.uint8)
        while (item := self.to_hash.get()) is not None:
            index, offset, n = item
            try:
                if self.error is None:
                    self._digest(index, offset, n)
                    self._check(index, offset, n, scratch)
            except BaseException as exc:  # handed to the filling thread
                self.error = exc
            self.to_write.put(item)
            for sink in self.optional:
                try:
                    if self.error is None:
                        self._give(sink, index, offset, n)
                finally:
                    self._release(index)

    def _give(self, sink: BufferSink, index: int, offset: int, n: int) -> None:
        """Buffer ``index`` (file offset ``offset``, ``n`` bytes) to ``sink``."""
        with memoryview(self.buffers[index]) as view, view[:n] as data:
            blocks = self.blocks.block_range(offset, offset + n)
            sink.take(offset, data, blocks, self.blocks.digests)

    def _release(self, index: int, writer: bool = False) -> None:
        """One holder (the ``writer``, or an optional sink) is done with buffer ``index``;
        the last one frees it. The writer done first: an optional sink alone holds it, and a
        wait for a free buffer is that sink's until it is done too."""
        with self.done_lock:
            self.done[index] += 1
            last = self.done[index] == self.holders
            if last:
                self.done[index] = 0
                self.held.discard(index)
            elif writer:
                self.held.add(index)
        if last:
            self.free.put(index)

    def _digest(self, index: int, offset: int, n: int) -> None:
        view = memoryview(self.buffers[index])
        try:
            for block in self.blocks.block_range(offset, offset + n):
                start, stop = self.blocks.span(block, self.size)
                hasher = new_hasher(self.blocks.algorithm)
                hasher.update(view[start - offset : stop - offset])
                self.blocks.digests[block] = hasher.hexdigest()
        finally:
            view.release()

    def _check(self, index: int, offset: int, n: int, scratch: np.ndarray) -> None:
        """Raise :class:`NonFiniteTensor` if a float tensor's bytes here hold NaN or inf."""
        stop = offset + n
        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        while i < len(self.floats) and self.floats[i].start < stop:
            span = self.floats[i]
            lo, hi = max(span.start, offset), min(span.stop, stop)
            buffer = self.buffers[index]
            if lo < hi and _non_finite(buffer, lo - offset, hi - lo, span.dtype, scratch):
                raise NonFiniteTensor(f"{span.name} holds NaN or infinite values")
            i += 1

    def _write_loop(self) -> None:
        """The needed sinks, in their order, buffer by buffer."""
        while (item := self.to_write.get()) is not None:
            index, offset, n = item
            try:
                for sink in self.needed:
                    if self.error is None:
                        self._give(sink, index, offset, n)
            except BaseException as exc:  # handed to the filling thread
                self.error = exc
            self._release(index, writer=True)


def _non_finite(
    buffer: mmap.mmap, start: int, length: int, dtype: str, scratch: np.ndarray
) -> bool:
    """Whether the ``dtype`` elements in ``buffer[start:start + length]`` hold NaN or inf."""
    size = DTYPE_SIZES[dtype]
    mask, limit = NON_FINITE[dtype]
    kind = _UNSIGNED[size]
    values = np.frombuffer(buffer, dtype=kind, count=length // size, offset=start)
    work = scratch.view(kind)
    step = len(work)
    for first in range(0, len(values), step):
        part = values[first : first + step]
        out = work[: len(part)]
        np.bitwise_and(part, kind(mask), out=out)
        if out.max() >= limit:
            return True
    return False


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
