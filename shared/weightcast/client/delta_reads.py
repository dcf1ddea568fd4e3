"""A node's base and the delta read: version N rebuilt in place over the verified blocks of
the version the node holds, each rebuilt block verified against N's digest before any of it
is used.

:class:`HeldBase` is what a reader keeps (``keep_base``): per file a :class:`HeldFile`, the
verified blocks it read packed in one host buffer, which the tensors it returned are views
of. :func:`delta_refusal` says why a version cannot be read by delta from it (the node then
reads the full version and reports why); :func:`apply_delta` applies the delta's frames of
exactly those blocks in place (:mod:`weightcast.contract.delta`) and verifies each result.
Nothing is copied: the node's cost is one decompression, one XOR and one hash per block. A
failure puts every block back (XOR is its own inverse), so the base, and the tensors the
caller holds, stay the version they were.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from weightcast.client.block_reads import tensor_bytes
from weightcast.client.confine import OpenFile
from weightcast.contract.delta import Delta, DeltaError, apply_block, decompressor
from weightcast.contract.manifest import FileEntry, Manifest, digest_bytes

WORKERS = 2
"""Blocks rebuilt at once (zstd, numpy and xxhash release the GIL)."""
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


def delta_refusal(base: HeldBase | None, manifest: Manifest, wants: tuple[object, ...]) -> str:
    """Why ``manifest``'s version cannot be read by delta from ``base`` ('' when it can)."""
    delta = manifest.delta
    if base is None:
        return "the node holds no earlier version"
    if delta is None:
        return f"version {manifest.version} has no delta"
    if delta.base_version != base.version:
        return (
            f"the delta of version {manifest.version} is from version {delta.base_version}; "
            f"the node holds version {base.version}"
        )
    if delta.base_manifest_sha256 != base.manifest_sha256:
        return f"the node's version {base.version} is not the delta's base (another manifest)"
    if wants != base.wants:
        return "the node holds another part of the base (another rank or tp)"
    return ""


@dataclass(frozen=True)
class _Job:
    entry: FileEntry
    held: HeldFile
    index: int
    frame: bytes


def apply_delta(
    delta: Delta, delta_file: OpenFile, files: Iterable[tuple[FileEntry, FileEntry, HeldFile]]
) -> int:
    """Turn the held blocks of the base into version N's, in place: for each (N's entry, the
    base's entry, the held file), the delta's frames of the held blocks applied, and every
    block verified against N's digest. Returns the delta bytes read.

    :class:`DeltaError` for a file the delta does not cover, blocks cut otherwise than in the
    base, a frame that does not decode, or a rebuilt block whose digest is not N's; every
    block changed by then is changed back first, so the held blocks are the base again."""
    jobs: list[_Job] = []
    read = 0
    for entry, base_entry, held in files:
        if entry.blocks is None or base_entry.blocks is None:
            raise DeltaError(f"{entry.name} has no block digests")
        if entry.blocks.starts != base_entry.blocks.starts:
            raise DeltaError(f"{entry.name} is cut into other blocks than in the base")
        frames = delta.frames(entry.name)
        if len(frames) != len(entry.blocks.digests):
            raise DeltaError(f"the delta does not cover {entry.name}")
        for index in sorted(held.offsets):
            offset, length = frames[index]
            frame = delta_file.read_at(offset, length) if length else b""
            jobs.append(_Job(entry, held, index, frame))
            read += length
    local = threading.local()
    applied: list[_Job] = []

    def unzstd(job: _Job) -> None:
        if not hasattr(local, "unzstd"):
            local.unzstd = decompressor()
        apply_block(job.frame, job.held.block(job.index), local.unzstd, in_place=True)

    def one(job: _Job) -> None:
        if job.frame:
            unzstd(job)
            applied.append(job)
        blocks = job.entry.blocks
        assert blocks is not None
        if (
            digest_bytes(blocks.algorithm, job.held.block(job.index).data)
            != blocks.digests[job.index]
        ):
            start, stop = blocks.span(job.index, job.entry.bytes)
            raise DeltaError(
                f"{job.entry.name}: bytes {start}..{stop} rebuilt from the delta do not match "
                f"the manifest's {blocks.algorithm} digest"
            )

    with ThreadPoolExecutor(WORKERS) as pool:
        outcomes = [pool.submit(one, job) for job in jobs]
    failed = next((e for o in outcomes if (e := o.exception()) is not None), None)
    if failed is not None:
        with ThreadPoolExecutor(WORKERS) as pool:
            list(pool.map(unzstd, applied))  # XOR again: the base, as it was
        raise failed
    return read
