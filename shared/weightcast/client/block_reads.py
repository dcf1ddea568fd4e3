"""Reading byte ranges of one file in whole blocks, each verified before its bytes are used.

The caller says which parts of which tensors it wants (:class:`Rect`: contiguous rows, or a
column block of a row-major matrix). The blocks that cover them are read in windows of at
most :data:`WINDOW_BYTES` (runs of consecutive blocks), up to :data:`READ_WINDOWS` of them
read at once on a pool while the caller's thread verifies them in order:

* bytes of a contiguous part go straight into the returned tensor (one ``preadv`` scattering
  the window over its destinations), and are hashed there;
* every other byte of the window (a column block's rows, other ranks' bytes sharing a block,
  the header) goes to a scratch buffer; column blocks are copied out of it once verified.

So every returned byte is one that was hashed, and nothing is read twice through a mapping.
A :class:`BlockCheck` verifies format 2's per-block digests (skipping blocks the node's
record lists; blocks of the manifest's ``lengths`` when it lists them, cut at the ranks'
boundaries), a :class:`WholeFileCheck` format 1's whole-file SHA-256 (the whole file is
read, in order, unless a sibling already checked it).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import hashlib
import mmap
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from weightcast.client.verified import Verified
from weightcast.contract.errors import WeightsError
from weightcast.contract.manifest import BLOCK_BYTES, FileEntry, new_hasher
from weightcast.contract.tensorfile import (
    PREFIX_BYTES,
    HeaderError,
    TensorSpan,
    header_length,
    parse_header,
)
from weightcast.store.base import StoredFile

WINDOW_BYTES = 64 * 1024 * 1024
"""Bytes read per window at most (whole blocks; at least one block)."""
READ_WINDOWS = 16
"""Windows read at once at most (each a ``read_into``: ranged GETs from S3)."""
SCRATCH_BYTES = 3 * WINDOW_BYTES
"""Scratch for the windows in flight and the one being verified, at most."""
WHOLE_FILE_GRID = BLOCK_BYTES
"""Read granularity in a format-1 file (whose one SHA-256 was already checked)."""


@dataclass(frozen=True)
class Rect:
    """Bytes of a tensor part in a file: ``rows`` runs of ``width`` bytes, ``stride`` apart,
    from ``offset``. A contiguous range is one row."""

    offset: int
    rows: int
    stride: int
    width: int

    @property
    def extent(self) -> tuple[int, int]:
        """The file range from the first byte to the last: what must be read."""
        if not self.rows or not self.width:
            return (self.offset, self.offset)
        return (self.offset, self.offset + (self.rows - 1) * self.stride + self.width)


@dataclass(frozen=True)
class Window:
    """File bytes ``[start, stop)`` as read: ``pieces`` (file offset, where the bytes went)
    cover it in order; the bytes that went to no tensor are in ``scratch`` at their offset
    from ``start``."""

    start: int
    stop: int
    pieces: list[tuple[int, memoryview]]
    scratch: memoryview


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable, for reading straight into it (keep the
    tensor alive while the view is used). Any other device is refused: its ``data_ptr`` is
    no host address."""
    if tensor.device.type != "cpu":
        raise ValueError(f"can only read into a CPU tensor, not one on {tensor.device}")
    if not tensor.numel():
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def copy_rect(rect: Rect, start: int, window: memoryview, out: torch.Tensor) -> None:
    """Copy the bytes of ``rect`` that lie in ``window`` (file bytes from ``start``) to their
    place in ``out`` (the part's bytes as a flat uint8 tensor, row after row)."""
    stop = start + len(window)
    first, last = rect.extent
    if first >= stop or last <= start or not rect.width:
        return
    source = torch.frombuffer(window, dtype=torch.uint8)
    rows = out.view(rect.rows, rect.width)
    stride = rect.stride or rect.width
    lo = max(0, (start - rect.offset - rect.width) // stride + 1)  # first row reaching in
    hi = min(rect.rows, (stop - 1 - rect.offset) // stride + 1)  # past the last row starting in
    full_lo = max(lo, -(-(start - rect.offset) // stride))
    full_hi = min(hi, (stop - rect.offset - rect.width) // stride + 1)
    if full_lo < full_hi:
        view = source.as_strided(
            (full_hi - full_lo, rect.width), (stride, 1), rect.offset + full_lo * stride - start
        )
        rows[full_lo:full_hi].copy_(view)
    for row in (*range(lo, min(full_lo, hi)), *range(max(full_hi, full_lo, lo), hi)):
        row_start = rect.offset + row * stride
        a, b = max(row_start, start), min(row_start + rect.width, stop)
        if a < b:
            rows[row, a - row_start : b - row_start].copy_(source[a - start : b - start])


class Check:
    """Verification of one file: which blocks to read, and hashing them as they arrive.

    ``starts``: the file offset where each block begins, then the file's end."""

    def __init__(self, entry: FileEntry, known: Verified, label: str, starts: list[int]) -> None:
        self.entry = entry
        self.known = known
        self.label = label
        self.starts = starts
        self.block_count = len(starts) - 1
        self.bytes_read = 0
        self.hashed = 0
        self.trusted = 0
        self.verified = Verified()

    def read(
        self, f: StoredFile, blocks: Iterable[int], direct: Sequence[tuple[int, memoryview]] = ()
    ) -> Iterator[Window]:
        """The given blocks, window by window, each verified before the caller sees it.
        ``direct`` (file offset, destination), sorted and disjoint: bytes to read straight
        into their destination (a tensor) rather than into the window's scratch."""
        # Closed here, not when collected: a window refused stops the reads at once.
        with contextlib.closing(_read_windows(f, self.windows(blocks), direct)) as windows:
            for window in windows:
                self.bytes_read += window.stop - window.start
                self.verify(window)
                yield window

    def needed(self, ranges: Iterable[tuple[int, int]]) -> set[int]:
        """The blocks that hold any byte of ``ranges``."""
        blocks: set[int] = set()
        for start, stop in ranges:
            blocks.update(self.block_range(start, stop))
        return blocks

    def block_range(self, start: int, stop: int) -> range:
        """The blocks that hold bytes ``[start, stop)``."""
        if stop <= start:
            return range(0)
        first = bisect.bisect_right(self.starts, start) - 1
        return range(max(first, 0), min(bisect.bisect_left(self.starts, stop), self.block_count))

    def windows(self, blocks: Iterable[int]) -> list[tuple[int, int]]:
        """Runs of consecutive blocks, cut into windows of at most WINDOW_BYTES (one block
        at least)."""
        windows: list[tuple[int, int]] = []
        run: list[int] = []
        for index in sorted(blocks):
            if run and (
                index != run[-1] + 1 or self.starts[index + 1] - self.starts[run[0]] > WINDOW_BYTES
            ):
                windows.append((self.starts[run[0]], self.starts[run[-1] + 1]))
                run = []
            run.append(index)
        if run:
            windows.append((self.starts[run[0]], self.starts[run[-1] + 1]))
        return windows

    def verify(self, window: Window) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Called once every window was read."""


class BlockCheck(Check):
    """Format 2: each block's digest, checked as it is read (each time: the header's blocks
    are read again with the tensors after them), unless a sibling verified it already."""

    def __init__(self, entry: FileEntry, known: Verified, label: str) -> None:
        assert entry.blocks is not None
        starts = entry.blocks.starts
        super().__init__(entry, known, label, [*starts[:-1], min(starts[-1], entry.bytes)])
        self._empty = new_hasher(entry.blocks.algorithm)
        self._done: set[int] = set()

    def verify(self, window: Window) -> None:
        assert self.entry.blocks is not None
        pieces = window.pieces
        at = 0  # the first piece that may hold the block's bytes
        for index in self.block_range(window.start, window.stop):
            start, stop = self.starts[index], self.starts[index + 1]
            while pieces[at][0] + len(pieces[at][1]) <= start:
                at += 1
            again = index in self._done  # read before (the header's): its bytes are new
            self._done.add(index)
            if index in self.known.blocks:
                self.trusted += not again
                continue
            hasher = self._empty.copy()
            for offset, data in pieces[at:]:
                if offset >= stop:
                    break
                hasher.update(data[max(start - offset, 0) : stop - offset])
            if hasher.hexdigest() != self.entry.blocks.digests[index]:
                raise WeightsError(
                    f"{self.label}: bytes {start}..{stop} do not match the manifest's "
                    f"{self.entry.blocks.algorithm} digest (the file is corrupt or was changed)"
                )
            self.hashed += not again
        self.verified = Verified(frozenset(self._done - self.known.blocks))


class WholeFileCheck(Check):
    """Format 1: one SHA-256 of the whole file. Unless a sibling checked it already, every
    block is read, in order, and hashed; the result is known only at the end."""

    def __init__(self, entry: FileEntry, known: Verified, label: str) -> None:
        starts = [*range(0, entry.bytes, WHOLE_FILE_GRID), entry.bytes]
        super().__init__(entry, known, label, starts)
        self._digest = None if known.whole else hashlib.sha256()
        self._hashed_to = 0

    def needed(self, ranges: Iterable[tuple[int, int]]) -> set[int]:
        if self._digest is None:
            return super().needed(ranges)
        return set(range(self.block_count))

    def verify(self, window: Window) -> None:
        count = len(self.block_range(window.start, window.stop))
        if self._digest is None:
            self.trusted += count
        elif window.start == self._hashed_to:  # every block, in order (see needed)
            for _, data in window.pieces:
                self._digest.update(data)
            self._hashed_to = window.stop
            self.hashed += count

    def finish(self) -> None:
        if self._digest is None:
            self.verified = self.known
            return
        if self._hashed_to != self.entry.bytes or self._digest.hexdigest() != self.entry.sha256:
            raise WeightsError(f"{self.label}: sha256 does not match the manifest")
        self.verified = Verified(whole=True)


def checker(entry: FileEntry, known: Verified, label: str) -> Check:
    """The check for ``entry``'s digests: per block (format 2) or whole file (format 1)."""
    if entry.blocks is None:
        return WholeFileCheck(entry, known, label)
    return BlockCheck(entry, known, label)


def read_header(f: StoredFile, check: Check) -> dict[str, TensorSpan]:
    """The file's tensors by name, from its header (:mod:`weightcast.contract.tensorfile`'s
    checks; a WeightsError naming the file). With block digests the header's blocks are
    verified before it is parsed; a format-1 file's header can only be verified with the
    whole file, so it is parsed first (defensively) and verified with the rest."""
    head = bytearray()
    _extend_head(f, check, head, min(f.size, PREFIX_BYTES))
    try:
        stop = PREFIX_BYTES + header_length(bytes(head[:PREFIX_BYTES]), f.size, f.label)
        _extend_head(f, check, head, stop)
        header = parse_header(bytes(head[PREFIX_BYTES:stop]), f.size, f.label)
    except HeaderError as exc:
        raise WeightsError(str(exc)) from None
    return {span.name: span for span in header.tensors}


def _extend_head(f: StoredFile, check: Check, head: bytearray, stop: int) -> None:
    """Extend ``head``, the file's first bytes, to at least ``stop`` bytes (whole verified
    blocks when the file has block digests)."""
    if len(head) >= stop:
        return
    if isinstance(check, BlockCheck):
        for window in check.read(f, check.needed([(len(head), stop)])):
            head += window.scratch
    else:
        head += f.read_at(len(head), stop - len(head))


def _pieces(
    start: int, stop: int, direct: Sequence[tuple[int, memoryview]], scratch: memoryview
) -> list[tuple[int, memoryview]]:
    """Where each byte of ``[start, stop)`` goes: its direct destination, else scratch."""
    pieces = []
    at = start
    first = max(0, bisect.bisect_right(direct, start, key=lambda d: d[0]) - 1)
    for offset, data in direct[first:]:
        if offset >= stop:
            break
        a, b = max(offset, start), min(offset + len(data), stop)
        if a >= b:
            continue
        assert a >= at, "direct destinations must not overlap"
        if at < a:
            pieces.append((at, scratch[at - start : a - start]))
        pieces.append((a, data[a - offset : b - offset]))
        at = b
    if at < stop:
        pieces.append((at, scratch[at - start : stop - start]))
    return pieces


def _read_windows(
    f: StoredFile, windows: list[tuple[int, int]], direct: Sequence[tuple[int, memoryview]]
) -> Iterator[Window]:
    """Each window read on a pool of threads, up to READ_WINDOWS at once with their scratch
    in one ring of at most SCRATCH_BYTES, and yielded in order; a window's scratch is reused
    once the caller asks for the next window. Many windows in flight keep a store that pays a
    round trip per request (S3) busy when a rank's windows are small. However this ends (a
    failed read, a window refused, the caller stopping), no read is left writing into the
    caller's buffers: the pool is shut down, its reads waited for."""
    if not windows:
        return
    largest = max(stop - start for start, stop in windows)
    ring = _Ring(max(largest, min(SCRATCH_BYTES, sum(stop - start for start, stop in windows))))
    pending = deque(windows)
    reading: deque[Future[Window]] = deque()
    pool = ThreadPoolExecutor(READ_WINDOWS, thread_name_prefix="weightcast-read")
    try:
        while pending or reading:
            while pending and len(reading) < READ_WINDOWS:
                start, stop = pending[0]
                scratch = ring.take(stop - start)
                if scratch is None:
                    break
                pending.popleft()
                reading.append(pool.submit(_read_window, f, start, stop, direct, scratch))
            yield reading.popleft().result()
            ring.release()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _read_window(
    f: StoredFile,
    start: int,
    stop: int,
    direct: Sequence[tuple[int, memoryview]],
    scratch: memoryview,
) -> Window:
    """File bytes ``[start, stop)``, each to its direct destination, else to ``scratch``."""
    pieces = _pieces(start, stop, direct, scratch)
    f.read_into([data for _, data in pieces], start)
    return Window(start, stop, pieces, scratch)


class _Ring:
    """Scratch for the windows in flight: they are given back in the order they were taken,
    so one buffer serves them all as a ring. An anonymous mapping, so that only the pages
    scratch bytes land in are ever touched (most of a window may go straight to tensors),
    and that a window's view keeps it alive."""

    def __init__(self, size: int) -> None:
        try:
            self._buffer = memoryview(mmap.mmap(-1, size))
        except OSError as exc:  # ENOMEM: what the reader reports as a version too large
            raise MemoryError(f"{size} bytes of scratch") from exc
        self._taken: deque[tuple[int, int]] = deque()  # (offset, length), oldest first

    def take(self, length: int) -> memoryview | None:
        """``length`` bytes after the newest taken (or from the start, wrapping); None while
        the oldest is in the way."""
        at = self._room(length)
        if at is None:
            return None
        self._taken.append((at, length))
        return self._buffer[at : at + length]

    def release(self) -> None:
        """Give the oldest taken back."""
        self._taken.popleft()

    def _room(self, length: int) -> int | None:
        if not self._taken:
            return 0 if length <= len(self._buffer) else None
        oldest = self._taken[0][0]
        head = sum(self._taken[-1])
        if head > oldest:  # taken: [oldest, head); free: the end, then the start
            if head + length <= len(self._buffer):
                return head
            return 0 if length <= oldest else None
        return head if head + length <= oldest else None  # wrapped: free is [head, oldest)
