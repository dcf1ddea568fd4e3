"""Reading a published version on a node: confined, verified, only the bytes a rank needs.

:class:`VersionReader` is the file side of a node, with no Redis: hand it a
:class:`~weightcast.client.versions.VersionInfo` (from a lease) and it

1. opens the version directory and every file without following symlinks, plain names only
   (:mod:`weightcast.client.confine`);
2. checks ``manifest.json`` against the registry's SHA-256 before parsing it, and that every
   tensor names a plain file the manifest lists (``hf/`` files are never opened);
3. plans the byte ranges the caller needs (a tensor-parallel rank: its rows of fused and
   vocab-parallel tensors, whole row-parallel tensors it then takes columns of, replicated
   tensors; or every tensor), and the blocks that cover them;
4. reads those blocks through a read-ahead thread, verifies each (block digests of format 2,
   or the whole-file SHA-256 of format 1) unless the node's record says a sibling process
   already did (:mod:`weightcast.client.verified`), and copies the needed bytes out of the
   verified buffer into the returned tensors, so no byte is used that was not checked.

Safetensors headers are parsed defensively (:mod:`weightcast.client.safetensors_header`)
after their own blocks are verified; every size is checked before anything is allocated.
"""

from __future__ import annotations

import hashlib
import math
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightcast.client.confine import (
    OpenFile,
    VersionDir,
    json_object,
    plain_name,
    registered_parts,
)
from weightcast.client.safetensors_header import (
    PREFIX_BYTES,
    TensorSpan,
    header_bytes,
    parse_header,
)
from weightcast.client.verified import NodeRecord, ProcessRecord, RecordKey, Verified
from weightcast.client.versions import VersionInfo
from weightcast.contract.errors import LayoutError, WeightsError
from weightcast.contract.layout import RankSlice, rank_slice
from weightcast.contract.manifest import (
    BLOCK_BYTES,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ManifestError,
    TensorEntry,
    sha256_bytes,
)
from weightcast.contract.snapshots import CONFIG_NAME

MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_CONFIG_BYTES = 16 * 1024 * 1024
WINDOW_BYTES = 64 * 1024 * 1024
"""Bytes read per read-ahead buffer (whole blocks; at least one block)."""
READ_AHEAD = 2
"""Windows read ahead of the one being verified and copied."""
WHOLE_FILE_GRID = BLOCK_BYTES
"""Read granularity in a format-1 file (whose one SHA-256 was already checked)."""


@dataclass(frozen=True)
class Want:
    """A tensor to return: all of it (``part`` None) or one rank's part of it."""

    entry: TensorEntry
    part: RankSlice | None


@dataclass
class ReadStats:
    """What the last read did: for benchmarks, tests and logs."""

    bytes_read: int = 0
    blocks_hashed: int = 0
    blocks_trusted: int = 0
    """Blocks not hashed because the node's record says they were verified already."""


def rank_wants(manifest: Manifest, tp_rank: int, tp_size: int) -> list[Want]:
    """What vLLM's tensor-parallel rank ``tp_rank`` of ``tp_size`` holds of each tensor.

    Per-rank files: that rank's entries, whole. Otherwise each tensor's
    :func:`~weightcast.contract.layout.rank_slice`. Raises
    :class:`~weightcast.contract.errors.LayoutError` for a ``tp_size`` the version cannot serve.
    """
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"rank {tp_rank} is outside tp={tp_size}")
    if manifest.per_rank_files:
        if manifest.tp != tp_size:
            raise LayoutError(
                f"version {manifest.version} has per-rank files for tp={manifest.tp}, "
                f"not tp={tp_size}"
            )
        return [Want(e, None) for e in manifest.tensors if e.rank == tp_rank]
    wants = []
    for entry in manifest.tensors:
        try:
            wants.append(Want(entry, rank_slice(entry.shard, entry.shape, tp_rank, tp_size)))
        except (KeyError, TypeError, IndexError):
            raise WeightsError(
                f"{MANIFEST_NAME}: tensor {entry.name} has a malformed shard {entry.shard!r}"
            ) from None
    return wants


def whole_wants(manifest: Manifest) -> list[Want]:
    """Every tensor whole; a version split into per-rank files has no whole tensors."""
    if manifest.per_rank_files:
        raise WeightsError(
            f"version {manifest.version} is split into per-rank files; read it with rank_tensors"
        )
    return [Want(e, None) for e in manifest.tensors]


class VersionReader:
    """Verified reads of published versions under ``weights_root`` (see the module doc).

    ``verified_dir``: a node-local directory shared by this node's reader processes (its
    vLLM workers) so that each block is verified once per node and version; None keeps the
    record in this process only.
    """

    def __init__(self, weights_root: Path | str, verified_dir: Path | str | None = None) -> None:
        given = Path(os.path.normpath(Path(weights_root).absolute()))
        self.root = given.resolve()
        self.root_as_given = given
        self.record = ProcessRecord() if verified_dir is None else NodeRecord(verified_dir)
        self.stats = ReadStats()

    def path(self, info: VersionInfo) -> Path:
        """Where the version is on this node (inside the weights root, or a WeightsError)."""
        return self.root.joinpath(*registered_parts(info.path, self.root, self.root_as_given))

    def manifest(self, info: VersionInfo) -> Manifest:
        """The manifest, checked against the registry's digest and for what a node opens."""
        with self._open(info) as directory:
            return self._manifest(directory, info)

    def config(self, info: VersionInfo) -> dict[str, Any]:
        """The version's HF ``config.json``, verified against the manifest."""
        with self._open(info) as directory:
            manifest = self._manifest(directory, info)
            entry = _file_entry(manifest, CONFIG_NAME)
            data = directory.read_small(CONFIG_NAME, MAX_CONFIG_BYTES, entry.bytes)
            _verify_bytes(entry, data, f"{directory.label}/{CONFIG_NAME}")
        return json_object(data, f"{directory.label}/{CONFIG_NAME}")

    def verify(self, info: VersionInfo) -> Manifest:
        """Check everything a node reads of the version: the manifest, ``config.json`` and
        every block of every file its tensors are in."""
        self.config(info)
        self.stats = ReadStats()
        with self._open(info) as directory:
            manifest = self._manifest(directory, info)
            for name in sorted({t.file for t in manifest.tensors}):
                entry = _file_entry(manifest, name)
                with directory.open(name, entry.bytes) as f:
                    self._read_file(f, _key(info), entry, [], everything=True)
        return manifest

    def load(self, info: VersionInfo) -> dict[str, torch.Tensor]:
        """Every tensor of the version, whole and verified."""
        return self._read(info, whole_wants)

    def rank_tensors(
        self, info: VersionInfo, tp_rank: int, tp_size: int
    ) -> dict[str, torch.Tensor]:
        """What vLLM's rank ``tp_rank`` of ``tp_size`` holds of each tensor, verified.

        Only the blocks covering that rank's byte ranges are read and verified (a whole
        row-parallel tensor, whose columns are the rank's part; per-rank files: that rank's
        file). Raises :class:`~weightcast.contract.errors.LayoutError` for a ``tp_size`` the
        version was not fused for, :class:`WeightsError` for anything wrong on disk.
        """
        return self._read(info, lambda manifest: rank_wants(manifest, tp_rank, tp_size))

    def _read(
        self, info: VersionInfo, plan: Callable[[Manifest], list[Want]]
    ) -> dict[str, torch.Tensor]:
        self.stats = ReadStats()
        with self._open(info) as directory:
            manifest = self._manifest(directory, info)
            wants: list[Want] = plan(manifest)
            by_file: dict[str, list[Want]] = {}
            for want in wants:
                by_file.setdefault(want.entry.file, []).append(want)
            tensors: dict[str, torch.Tensor] = {}
            for name, file_wants in by_file.items():
                entry = _file_entry(manifest, name)
                with directory.open(name, entry.bytes) as f:
                    tensors |= self._read_file(f, _key(info), entry, file_wants)
        return tensors

    def _open(self, info: VersionInfo) -> VersionDir:
        return VersionDir(self.root, registered_parts(info.path, self.root, self.root_as_given))

    def _manifest(self, directory: VersionDir, info: VersionInfo) -> Manifest:
        label = f"{directory.label}/{MANIFEST_NAME}"
        data = directory.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
        if sha256_bytes(data) != info.manifest_sha256:
            raise WeightsError(f"{label}: sha256 differs from the registry's manifest_sha256")
        try:
            manifest = Manifest.from_json(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            problem = f"lacks {exc}" if isinstance(exc, KeyError) else str(exc)
            raise WeightsError(f"{label}: not a valid manifest ({problem})") from None
        check_node_manifest(manifest, label)
        return manifest

    def _read_file(
        self,
        f: OpenFile,
        key: RecordKey,
        entry: FileEntry,
        wants: Sequence[Want],
        everything: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The wanted tensors of one open file, out of verified blocks only."""
        check = _checker(entry, self.record.known(key, entry.name, f.identity), f.label)
        spans = _read_header(f, check)
        parts = [_part(want, spans, f.label) for want in wants]
        outputs = {p.name: torch.empty(p.shape, dtype=p.dtype) for p in parts}
        flat = {p.name: _bytes_of(outputs[p.name]) for p in parts}
        if everything:
            blocks: Iterable[int] = range(check.block_count)
        else:
            blocks = check.needed(p.rect.extent for p in parts)
        for start, window in check.read(f, blocks):
            for p in parts:
                copy_rect(p.rect, start, window, flat[p.name])
        check.finish()
        self.stats.bytes_read += check.bytes_read
        self.stats.blocks_hashed += check.hashed
        self.stats.blocks_trusted += check.trusted
        self.record.add(key, entry.name, f.identity, check.verified)
        return outputs


def check_node_manifest(manifest: Manifest, label: str) -> None:
    """What a node relies on before opening any file the manifest names."""
    listed = {f.name for f in manifest.files}
    if CONFIG_NAME not in listed:
        raise WeightsError(f"{label}: lists no {CONFIG_NAME}")
    for t in manifest.tensors:
        plain_name(t.file, f"{label}: tensor {t.name} names the file")
        if t.file not in listed:
            raise WeightsError(
                f"{label}: tensor {t.name} is in {t.file!r}, a file the manifest does not list"
            )
        if not isinstance(t.shard, dict) or not _is_shape(t.shape):
            raise WeightsError(f"{label}: tensor {t.name} has a malformed shape or shard")
        if manifest.per_rank_files and not isinstance(t.rank, int):
            raise WeightsError(f"{label}: tensor {t.name} of a per-rank version has no rank")


def _is_shape(shape: Any) -> bool:
    return isinstance(shape, list) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    )


def _key(info: VersionInfo) -> RecordKey:
    return RecordKey(info.version, info.manifest_sha256)


def _file_entry(manifest: Manifest, name: str) -> FileEntry:
    for entry in manifest.files:
        if entry.name == name:
            return entry
    raise WeightsError(f"{MANIFEST_NAME}: {name} is not among the files it lists")


def _verify_bytes(entry: FileEntry, data: bytes, label: str) -> None:
    """A small file read whole: every block, or the SHA-256."""
    if entry.blocks is None:
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise WeightsError(f"{label}: sha256 does not match the manifest")
        return
    try:
        for index in range(len(entry.blocks.digests)):
            entry.verify_block(index, data[slice(*entry.blocks.span(index, len(data)))])
    except ManifestError as exc:
        raise WeightsError(f"{label.rsplit('/', 1)[0]}/{exc}") from None


# -- what to read ------------------------------------------------------------------------


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
class _Part:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    rect: Rect


def _part(want: Want, spans: dict[str, TensorSpan], label: str) -> _Part:
    """The rect and shape of a wanted tensor, checked against the file's header."""
    entry, part = want.entry, want.part
    span = spans.get(entry.name)
    if span is None or list(span.shape) != entry.shape or span.dtype_name != entry.dtype:
        raise WeightsError(
            f"{label}: tensor {entry.name} is missing or not {entry.dtype} {entry.shape}"
        )
    item, shape = span.dtype.itemsize, span.shape
    if part is None:
        return _Part(entry.name, span.dtype, shape, Rect(span.start, 1, 0, span.stop - span.start))
    count = part.stop - part.start
    if part.dim == 0:
        row = math.prod(shape[1:]) * item
        rect = Rect(span.start + part.start * row, 1, 0, count * row)
        return _Part(entry.name, span.dtype, (count, *shape[1:]), rect)
    if part.dim == 1 and len(shape) == 2:
        rect = Rect(span.start + part.start * item, shape[0], shape[1] * item, count * item)
        return _Part(entry.name, span.dtype, (shape[0], count), rect)
    raise LayoutError(f"{entry.name}: cannot take a part along dim {part.dim} of {list(shape)}")


def copy_rect(rect: Rect, start: int, window: memoryview, out: torch.Tensor) -> None:
    """Copy the bytes of ``rect`` that lie in ``window`` (file bytes from ``start``) to their
    place in ``out`` (the part's bytes, row after row)."""
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


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    if not tensor.numel():
        return torch.empty(0, dtype=torch.uint8)
    return tensor.view(-1).view(torch.uint8)


# -- verifying what is read ----------------------------------------------------------------


class _Check:
    """Verification of one file: which blocks to read, and hashing them as they arrive."""

    def __init__(self, entry: FileEntry, known: Verified, label: str, block_bytes: int) -> None:
        self.entry = entry
        self.known = known
        self.label = label
        self.block_bytes = block_bytes
        self.block_count = -(-entry.bytes // block_bytes)
        self.bytes_read = 0
        self.hashed = 0
        self.trusted = 0
        self.verified = Verified()

    def read(self, f: OpenFile, blocks: Iterable[int]) -> Iterator[tuple[int, memoryview]]:
        """The given blocks' bytes, window by window (file offset, bytes), each verified
        before the caller sees it."""
        for start, window in _read_windows(f, self.windows(blocks)):
            self.bytes_read += len(window)
            self.verify(start, window)
            yield start, window

    def needed(self, ranges: Iterable[tuple[int, int]]) -> set[int]:
        blocks: set[int] = set()
        for start, stop in ranges:
            if stop > start:
                blocks.update(range(start // self.block_bytes, (stop - 1) // self.block_bytes + 1))
        return blocks

    def windows(self, blocks: Iterable[int]) -> list[tuple[int, int]]:
        """Runs of consecutive blocks, cut into windows of at most WINDOW_BYTES (one block
        at least)."""
        per_window = max(1, WINDOW_BYTES // self.block_bytes)
        windows: list[tuple[int, int]] = []
        run: list[int] = []
        for index in sorted(blocks):
            if run and (index != run[-1] + 1 or len(run) == per_window):
                windows.append(self._span(run))
                run = []
            run.append(index)
        if run:
            windows.append(self._span(run))
        return windows

    def _span(self, run: list[int]) -> tuple[int, int]:
        return run[0] * self.block_bytes, min((run[-1] + 1) * self.block_bytes, self.entry.bytes)

    def verify(self, start: int, window: memoryview) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Called once every window was read."""


class _BlockCheck(_Check):
    """Format 2: each block's digest, checked as it is read, unless already verified."""

    def __init__(self, entry: FileEntry, known: Verified, label: str) -> None:
        assert entry.blocks is not None
        super().__init__(entry, known, label, entry.blocks.block_bytes)
        self._done: set[int] = set()

    def verify(self, start: int, window: memoryview) -> None:
        first = start // self.block_bytes
        for offset in range(0, len(window), self.block_bytes):
            index = first + offset // self.block_bytes
            if index in self._done:
                continue
            if index in self.known.blocks:
                self.trusted += 1
                self._done.add(index)
                continue
            try:
                self.entry.verify_block(index, window[offset : offset + self.block_bytes])
            except ManifestError as exc:
                raise WeightsError(f"{self.label.rsplit('/', 1)[0]}/{exc}") from None
            self._done.add(index)
            self.hashed += 1
        self.verified = Verified(frozenset(self._done - self.known.blocks))


class _WholeFileCheck(_Check):
    """Format 1: one SHA-256 of the whole file. Unless a sibling checked it already, every
    block is read, in order, and hashed; the result is known only at the end."""

    def __init__(self, entry: FileEntry, known: Verified, label: str) -> None:
        super().__init__(entry, known, label, WHOLE_FILE_GRID)
        self._digest = None if known.whole else hashlib.sha256()
        self._hashed_to = 0

    def needed(self, ranges: Iterable[tuple[int, int]]) -> set[int]:
        if self._digest is None:
            return super().needed(ranges)
        return set(range(self.block_count))

    def verify(self, start: int, window: memoryview) -> None:
        count = -(-len(window) // self.block_bytes)
        if self._digest is None:
            self.trusted += count
        elif start == self._hashed_to:  # every block, in order (see needed)
            self._digest.update(window)
            self._hashed_to += len(window)
            self.hashed += count

    def finish(self) -> None:
        if self._digest is None:
            self.verified = self.known
            return
        if self._hashed_to != self.entry.bytes or self._digest.hexdigest() != self.entry.sha256:
            raise WeightsError(f"{self.label}: sha256 does not match the manifest")
        self.verified = Verified(whole=True)


def _checker(entry: FileEntry, known: Verified, label: str) -> _Check:
    if entry.blocks is None:
        return _WholeFileCheck(entry, known, label)
    return _BlockCheck(entry, known, label)


def _read_header(f: OpenFile, check: _Check) -> dict[str, TensorSpan]:
    """The file's tensors from its header. With block digests the header's blocks are
    verified before it is parsed; a format-1 file's header can only be verified with the
    whole file, so it is parsed first (defensively) and verified with the rest."""
    head = bytearray()
    _extend_head(f, check, head, min(f.size, PREFIX_BYTES))
    stop = PREFIX_BYTES + header_bytes(bytes(head[:PREFIX_BYTES]), f.size, f.label)
    _extend_head(f, check, head, stop)
    return parse_header(bytes(head[PREFIX_BYTES:stop]), f.size, f.label)


def _extend_head(f: OpenFile, check: _Check, head: bytearray, stop: int) -> None:
    """Extend ``head``, the file's first bytes, to at least ``stop`` bytes (whole verified
    blocks when the file has block digests)."""
    if len(head) >= stop:
        return
    if isinstance(check, _BlockCheck):
        for _, window in check.read(f, check.needed([(len(head), stop)])):
            head += window
    else:
        head += f.read_at(len(head), stop - len(head))


def _read_windows(f: OpenFile, windows: list[tuple[int, int]]) -> Iterator[tuple[int, memoryview]]:
    """Each window's bytes, read ahead by a thread while the caller verifies and copies the
    one before; a buffer is reused once the caller asks for the next window."""
    if not windows:
        return
    size = max(stop - start for start, stop in windows)
    free: queue.Queue[bytearray | None] = queue.Queue()
    for _ in range(min(READ_AHEAD + 1, len(windows))):
        free.put(bytearray(size))
    ready: queue.Queue[tuple[int, memoryview, bytearray] | BaseException | None] = queue.Queue()

    def read() -> None:
        try:
            for start, stop in windows:
                buffer = free.get()
                if buffer is None:
                    return
                view = memoryview(buffer)[: stop - start]
                f.read_into(view, start)
                ready.put((start, view, buffer))
            ready.put(None)
        except BaseException as exc:  # handed to the caller's thread
            ready.put(exc)

    reader = threading.Thread(target=read, name="weightcast-read", daemon=True)
    reader.start()
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            start, view, buffer = item
            yield start, view
            free.put(buffer)
    finally:
        free.put(None)
        reader.join()
