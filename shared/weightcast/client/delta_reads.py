"""A node's base and the delta read: version N rebuilt in place over the verified blocks of
the version the node holds, each rebuilt block verified against N's digest before any of it
is used.

:class:`HeldBase` is what a reader keeps (``keep_base``): per file a :class:`HeldFile`, the
verified blocks it read packed in one host buffer, which the tensors it returned are views
of. :func:`delta_refusal` says why a delta cannot rebuild its version from the one held, or
from the link before it in a chain (the node then reads the full version and reports why);
:class:`DeltaApply` applies the delta's frames of exactly those blocks in place
(:mod:`weightcast.contract.delta`) and verifies each result.
Nothing is copied: the node's cost per changed block is one decompression of its frame, an
XOR of the bytes that changed, and one hash. A failure puts every block back (XOR is its own
inverse), so the base, and the tensors the caller holds, stay the version they were.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from weightcast.client.block_reads import tensor_bytes
from weightcast.contract.delta import (
    Delta,
    DeltaError,
    apply_block,
    decompressor,
    frame_bound,
    scratch_bytes,
)
from weightcast.contract.errors import WeightsError
from weightcast.contract.manifest import FileEntry, Manifest, digest_bytes
from weightcast.store.base import StoredFile

WORKERS = 2
"""Jobs run at once (zstd, numpy and xxhash release the GIL)."""
IN_FLIGHT = 2 * WORKERS
"""Jobs read and queued or running at once: the window that bounds a read's work in flight."""
JOB_BLOCKS = 64
"""Blocks a job rebuilds at most (one future per job, not per block)."""
JOB_BYTES = 16 * 1024 * 1024
"""Frame bytes a job reads at most (one frame at least)."""
_ALIGN = 64
"""Each run of blocks sits at the same offset modulo this in the buffer as in the file, so
a tensor aligned in the file is aligned in the buffer (and can be a view of it)."""


@dataclass
class HeldFile:
    """The verified blocks of one file a node holds, in one host buffer: runs of consecutive
    blocks adjacent, so the bytes of a file range whose blocks are all held are one slice."""

    starts: list[int]
    """Where each block of the file begins, then the file's end."""
    offsets: dict[int, int]
    """Block index -> where its bytes are in :attr:`data`."""
    data: torch.Tensor
    """uint8, on the CPU."""

    @classmethod
    def allocate(cls, starts: list[int], blocks: Iterable[int]) -> HeldFile:
        """Room for ``blocks`` of a file cut at ``starts``."""
        offsets: dict[int, int] = {}
        at = 0
        for index in sorted(blocks):
            if index - 1 not in offsets:  # a new run: align it as the file does
                at += (starts[index] - at) % _ALIGN
            offsets[index] = at
            at += starts[index + 1] - starts[index]
        return cls(starts, offsets, torch.empty(at, dtype=torch.uint8, device="cpu"))

    def block(self, index: int) -> np.ndarray:
        """Block ``index``'s bytes, writable (a view)."""
        at = self.offsets[index]
        return self.data.numpy()[at : at + self.starts[index + 1] - self.starts[index]]

    def runs(self) -> list[tuple[int, memoryview]]:
        """(file offset, writable bytes) of each run of consecutive held blocks, in order:
        where a full read puts what it reads."""
        runs: list[tuple[int, memoryview]] = []
        indices = sorted(self.offsets)
        for at, index in enumerate(indices):
            if at == 0 or indices[at - 1] != index - 1:
                first = index  # a run starts here
            if at + 1 == len(indices) or indices[at + 1] != index + 1:  # and ends here
                start, stop = self.starts[first], self.starts[index + 1]
                lo = self.offsets[first]
                runs.append((start, tensor_bytes(self.data[lo : lo + stop - start])))
        return runs

    def span(self, start: int, stop: int) -> torch.Tensor | None:
        """File bytes ``[start, stop)`` as a uint8 view, or None when a block of them is
        not held."""
        if stop <= start:
            return self.data[:0]
        first = bisect.bisect_right(self.starts, start) - 1
        last = bisect.bisect_left(self.starts, stop) - 1
        if first < 0 or any(i not in self.offsets for i in range(first, last + 1)):
            return None
        at = self.offsets[first] + start - self.starts[first]
        return self.data[at : at + stop - start]


@dataclass
class HeldBase:
    """The version a node holds, as the verified blocks it read (``wants`` says for what:
    ``("rank", r, tp, ep)`` or ``("whole",)``)."""

    version: int
    manifest_sha256: str
    manifest: Manifest
    wants: tuple[object, ...]
    files: dict[str, HeldFile] = field(default_factory=dict)


def delta_refusal(version: int, manifest: Manifest, before: tuple[int, str], held: bool) -> str:
    """Why version ``version``'s delta (its ``manifest``'s) cannot rebuild it from ``before``
    (a version's number and manifest SHA-256: the one the node holds when ``held``, else the
    link before it in a chain); '' when it can."""
    delta = manifest.delta
    if delta is None:
        return f"version {version} has no delta"
    if delta.refusal():
        return delta.refusal()
    number, digest = before
    if delta.base_version != number:
        where = "the node holds" if held else "the link before it is"
        return (
            f"the delta of version {version} is from version {delta.base_version}; "
            f"{where} version {number}"
        )
    if delta.base_manifest_sha256 != digest:
        whose = "the node's" if held else "the link"
        return f"{whose} version {number} is not the delta's base (another manifest)"
    return ""


def held_frame_bytes(delta: Delta, name: str, held: HeldFile) -> int:
    """The bytes of ``delta``'s frames of the blocks of file ``name`` a node holds: what
    applying it reads (:class:`DeltaError` for a file it does not cover)."""
    listed = delta.file_frames(name)
    if listed is None or len(listed[1]) != len(held.starts) - 1:
        raise DeltaError(f"the delta does not cover {name}")
    lengths = listed[1]
    return sum(lengths[index] for index in held.offsets)


def held_block_bytes(held: HeldFile) -> int:
    """The bytes of the blocks held: what a full read of the same part reads."""
    return sum(held.starts[index + 1] - held.starts[index] for index in held.offsets)


@dataclass
class _FileFrames:
    """The held blocks of one file and where their frames are in the delta file, as arrays
    (a few bytes a block, whatever the count); ``done`` marks the blocks changed so far."""

    entry: FileEntry
    held: HeldFile
    indices: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    done: np.ndarray


@dataclass(frozen=True)
class _Job:
    """Held blocks ``[lo, hi)`` of one file, their frames read as one piece from ``start``."""

    file: _FileFrames
    lo: int
    hi: int
    start: int
    frames: bytes

    def frame(self, at: int) -> memoryview:
        offset = int(self.file.offsets[at]) - self.start
        return memoryview(self.frames)[offset : offset + int(self.file.lengths[at])]


class DeltaApply:
    """Version N's held blocks rebuilt from the base's in place, all or nothing.

    Made from the delta and the held files (:class:`DeltaError` for a file the delta does not
    cover, blocks cut otherwise than in the base, a frame longer than any frame of its block):
    nothing is read or changed yet. :meth:`apply` changes every held block, verifying each
    against N's digest, through a bounded window of jobs (work and memory grow with the bytes
    read, not with a future per block); :meth:`revert` changes them back (XOR is its own
    inverse), from the frames already read: the reader's one rollback rule, for one delta
    or each link of a chain."""

    def __init__(
        self,
        delta: Delta,
        frames: StoredFile,
        files: Iterable[tuple[FileEntry, FileEntry, HeldFile]],
    ) -> None:
        self.frames = frames
        self.codec = delta.codec
        self.files: list[_FileFrames] = []
        self.jobs: list[_Job] = []
        """Every job read so far, kept for :meth:`revert` (their frames: the bytes read)."""
        self.bytes_read = 0
        for entry, base_entry, held in files:
            if entry.blocks is None or base_entry.blocks is None:
                raise DeltaError(f"{entry.name} has no block digests")
            if entry.blocks.starts != base_entry.blocks.starts:
                raise DeltaError(f"{entry.name} is cut into other blocks than in the base")
            listed = delta.file_frames(entry.name)
            if listed is None or len(listed[1]) != len(entry.blocks.digests):
                raise DeltaError(f"the delta does not cover {entry.name}")
            first, lengths = listed
            indices = np.fromiter(sorted(held.offsets), np.int64, len(held.offsets))
            every = np.asarray(lengths, np.int64)
            offsets = first + np.cumsum(every) - every
            starts = np.asarray(entry.blocks.starts, np.int64)
            sizes = starts[indices + 1] - starts[indices]
            too_long = every[indices] > frame_bound(sizes, delta.codec)
            if too_long.any():
                index = int(indices[np.argmax(too_long)])
                raise DeltaError(
                    f"{entry.name}: the frame of block {index} ({lengths[index]} bytes) is "
                    f"longer than any frame of its {int(sizes[np.argmax(too_long)])} bytes"
                )
            self.files.append(
                _FileFrames(
                    entry,
                    held,
                    indices,
                    offsets[indices],
                    every[indices],
                    np.zeros(len(indices), np.bool_),
                )
            )

    def apply(self) -> int:
        """Change every held block into version N's and verify it; on any failure every block
        changed is changed back, then the error raised. Returns the delta bytes read."""
        local = threading.local()
        in_flight: deque[Future[None]] = deque()
        failed: BaseException | None = None

        def run(job: _Job) -> None:
            if not hasattr(local, "unzstd"):
                local.unzstd = decompressor()
                local.scratch = np.empty(0, np.uint8)
            self._apply(job, local, self.codec)

        with ThreadPoolExecutor(WORKERS) as pool:
            try:
                for job in self._jobs():
                    if len(in_flight) >= IN_FLIGHT and (failed := in_flight.popleft().exception()):
                        break
                    in_flight.append(pool.submit(run, job))
            except BaseException as exc:  # a frame that cannot be read: wait, then undo
                failed = exc
            for future in in_flight:
                failed = failed or future.exception()
        if failed is not None:
            self.revert()
            raise failed
        return self.bytes_read

    def revert(self) -> None:
        """Every block changed so far changed back: the held blocks are the base again."""
        unzstd, scratch = decompressor(), np.empty(0, np.uint8)
        for job in self.jobs:
            for at in range(job.lo, job.hi):
                if job.file.done[at]:
                    block = job.file.held.block(int(job.file.indices[at]))
                    scratch = _room(scratch, scratch_bytes(block.size, self.codec))
                    apply_block(
                        job.frame(at), block, unzstd, True, scratch=scratch, codec=self.codec
                    )
                    job.file.done[at] = False

    def _jobs(self) -> Iterator[_Job]:
        """Runs of held blocks whose frames follow each other, at most JOB_BLOCKS blocks and
        JOB_BYTES of frames (one frame at least) each, their frames read as one piece."""
        for file in self.files:
            count, lo = len(file.indices), 0
            while lo < count:
                start = int(file.offsets[lo])
                hi = lo + 1
                while (
                    hi < count
                    and hi - lo < JOB_BLOCKS
                    and file.indices[hi] == file.indices[hi - 1] + 1
                    and file.offsets[hi] + file.lengths[hi] - start <= JOB_BYTES
                ):
                    hi += 1
                stop = int(file.offsets[hi - 1] + file.lengths[hi - 1])
                job = _Job(file, lo, hi, start, self._read(start, stop - start))
                self.jobs.append(job)
                yield job
                lo = hi

    def _read(self, offset: int, length: int) -> bytes:
        if not length:
            return b""
        try:
            data = self.frames.read_at(offset, length)
        except WeightsError as exc:  # the delta file shrank: a damaged delta
            raise DeltaError(str(exc)) from None
        self.bytes_read += length
        return data

    @staticmethod
    def _apply(job: _Job, local: threading.local, codec: str) -> None:
        file = job.file
        for at in range(job.lo, job.hi):
            index = int(file.indices[at])
            block = file.held.block(index)
            if file.lengths[at]:
                local.scratch = _room(local.scratch, scratch_bytes(block.size, codec))
                apply_block(
                    job.frame(at), block, local.unzstd, True, scratch=local.scratch, codec=codec
                )
                file.done[at] = True
            _verify(file, index, block)


def _room(scratch: np.ndarray, size: int) -> np.ndarray:
    """``scratch``, or a larger one when it is shorter than ``size``."""
    return scratch if scratch.size >= size else np.empty(size, np.uint8)


def _verify(file: _FileFrames, index: int, block: np.ndarray) -> None:
    blocks = file.entry.blocks
    assert blocks is not None
    if digest_bytes(blocks.algorithm, block.data) != blocks.digests[index]:
        start, stop = blocks.span(index, file.entry.bytes)
        raise DeltaError(
            f"{file.entry.name}: bytes {start}..{stop} rebuilt from the delta do not match "
            f"the manifest's {blocks.algorithm} digest"
        )
