"""A node's base and the delta read: version N rebuilt from the verified blocks of the
version the node holds, each rebuilt block verified against N's digest before any of it is
used.

:class:`HeldBase` is what a reader keeps after a full read (``keep_base``): the raw bytes of
every block it read and verified, per file, and what it read them for (a rank of a tp, or
every tensor). :func:`delta_refusal` says why a version cannot be read by delta from it (the
node then reads the full version and reports why); :func:`rebuild` applies the delta's frames
of exactly those blocks (:mod:`weightcast.contract.delta`) and verifies each result.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from weightcast.client.block_reads import Window
from weightcast.client.confine import OpenFile
from weightcast.contract.delta import Delta, DeltaError, apply_block, decompressor
from weightcast.contract.manifest import FileEntry, Manifest, digest_bytes

Blocks = dict[int, np.ndarray]
"""Block index -> its verified bytes, for one file."""
WORKERS = 2
"""Blocks rebuilt at once (zstd, numpy and xxhash release the GIL)."""


@dataclass
class HeldBase:
    """The version a node holds, as the verified blocks it read (``wants`` says for what:
    ``("rank", r, tp)`` or ``("whole",)``)."""

    version: int
    manifest_sha256: str
    manifest: Manifest
    wants: tuple[object, ...]
    blocks: dict[str, Blocks] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for f in self.blocks.values() for b in f.values())


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


def capture(window: Window, starts: list[int], wanted: Iterable[int], into: Blocks) -> None:
    """Keep a copy of each of ``wanted`` blocks (file offsets ``starts``) that lies in the
    verified ``window``, from wherever its bytes went (the tensors, or scratch)."""
    wanted = set(wanted)
    for offset, data in window.pieces:
        stop = offset + len(data)
        for index in _blocks_in(starts, offset, stop):
            if index not in wanted:
                continue
            start, end = starts[index], starts[index + 1]
            block = into.get(index)
            if block is None:
                block = into[index] = np.empty(end - start, np.uint8)
            lo, hi = max(start, offset), min(end, stop)
            block[lo - start : hi - start] = np.frombuffer(data, np.uint8)[
                lo - offset : hi - offset
            ]


def _blocks_in(starts: list[int], start: int, stop: int) -> range:
    first = max(bisect.bisect_right(starts, start) - 1, 0)
    return range(first, min(bisect.bisect_left(starts, stop), len(starts) - 1))


def rebuild(
    delta: Delta,
    delta_file: OpenFile,
    entry: FileEntry,
    base_entry: FileEntry,
    held: Blocks,
) -> tuple[Blocks, int]:
    """Version N's blocks of one file from the ``held`` blocks of the base and the delta's
    frames for them; each verified against N's digest. Returns them and the delta bytes read.

    The blocks are rebuilt in place (no second copy of the part): once this raises, the held
    blocks are no longer the base, and the caller must drop them. :class:`DeltaError` for a
    file the delta does not cover, blocks cut otherwise than in the base, a frame that does
    not decode, or a rebuilt block whose digest is not N's."""
    if entry.blocks is None or base_entry.blocks is None:
        raise DeltaError(f"{entry.name} has no block digests")
    if entry.blocks.starts != base_entry.blocks.starts:
        raise DeltaError(f"{entry.name} is cut into other blocks than in the base")
    frames = delta.frames(entry.name)
    if len(frames) != len(entry.blocks.digests):
        raise DeltaError(f"the delta does not cover {entry.name}")
    indices = sorted(held)
    wanted = [frames[index] for index in indices]
    data = [delta_file.read_at(offset, length) if length else b"" for offset, length in wanted]
    local = threading.local()

    def one(index: int, frame: bytes) -> np.ndarray:
        block = held[index]
        if frame:
            if not hasattr(local, "unzstd"):
                local.unzstd = decompressor()
            block = apply_block(frame, block, local.unzstd, in_place=True)
        assert entry.blocks is not None
        if digest_bytes(entry.blocks.algorithm, block.data) != entry.blocks.digests[index]:
            start, stop = entry.blocks.span(index, entry.bytes)
            raise DeltaError(
                f"{entry.name}: bytes {start}..{stop} rebuilt from the delta do not match the "
                f"manifest's {entry.blocks.algorithm} digest"
            )
        return block

    with ThreadPoolExecutor(WORKERS) as pool:
        rebuilt = dict(zip(indices, pool.map(one, indices, data), strict=True))
    read = sum(length for _, length in wanted)
    return rebuilt, read
