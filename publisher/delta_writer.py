"""The delta of a new version from the previous one, written beside it by the publisher.

Why here: the publisher has just written the new version (its bytes are in the page cache)
and wrote the previous one minutes ago (likely still cached), so the delta costs an XOR and
a zstd pass over blocks that changed, and no trainer time. Blocks whose digests are equal in
both manifests are marked unchanged without being read. The math is
:mod:`weightcast.contract.delta`; this module only finds the base, checks that its plan is
the new version's (same files, tensors and block boundaries: else no delta), and writes the
frames in order, two blocks at a time (numpy's XOR and zstd release the GIL).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weightcast.contract.delta import (
    Delta,
    DeltaFile,
    compressor,
    delta_file_name,
    encode_block,
)
from weightcast.contract.durable import fsync_path
from weightcast.contract.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ManifestError,
    TensorEntry,
    file_entry,
    sha256_bytes,
)
from weightcast.runtime.logs import get_logger

log = get_logger("publisher")

_VERSION_DIR = re.compile(r"v([0-9]+)")
WORKERS = 2
"""Blocks encoded at once."""
_local = threading.local()
"""Each worker thread's zstd compressor (one is not shared between threads)."""


@dataclass(frozen=True)
class Base:
    """The version a delta is taken from: its directory, manifest and the manifest's digest."""

    path: Path
    manifest: Manifest
    manifest_sha256: str


def find_base(weights_dir: Path, version: int) -> Base | None:
    """The newest published version below ``version`` (its ``v<N>`` directory, manifest
    readable), or None."""
    numbers = sorted(
        (int(m.group(1)) for p in weights_dir.iterdir() if (m := _VERSION_DIR.fullmatch(p.name))),
        reverse=True,
    )
    for number in (n for n in numbers if n < version):
        path = weights_dir / f"v{number}"
        try:
            text = (path / MANIFEST_NAME).read_bytes()
            return Base(path, Manifest.from_json(text), sha256_bytes(text))
        except (OSError, ManifestError) as exc:
            log.warning("no delta base", version=number, reason=str(exc))
            return None
    return None


def same_plan(base: Manifest, files: Sequence[FileEntry], tensors: Sequence[TensorEntry]) -> str:
    """Why a delta cannot be taken from ``base`` for a version of these files and tensors
    ('' when it can): block ``i`` must hold the same tensor bytes in both."""
    if base.format != MANIFEST_FORMAT:
        return f"the base is {base.format}"
    if list(base.tensors) != list(tensors):
        return "the base has other tensors (names, shapes, dtypes or shards)"
    listed = {f.name: f for f in base.files}
    for entry in files:
        old = listed.get(entry.name)
        if old is None or old.blocks is None or entry.blocks is None:
            return f"{entry.name} has no block digests in both versions"
        if old.bytes != entry.bytes or old.blocks.starts != entry.blocks.starts:
            return f"{entry.name} is cut into other blocks"
        if old.blocks.algorithm != entry.blocks.algorithm:
            return f"{entry.name} has {old.blocks.algorithm} digests in the base"
    return ""


def write_delta(
    directory: Path,
    files: Sequence[FileEntry],
    tensors: Sequence[TensorEntry],
    base: Base,
    digest: str,
) -> tuple[Delta, FileEntry] | None:
    """Write ``directory``'s delta from ``base`` for the weights ``files`` (already written
    there, with their entries); the manifest's :class:`Delta` and the delta file's entry
    (``digest`` blocks), or None (logged) when the plans differ."""
    why = same_plan(base.manifest, files, tensors)
    if why:
        log.info("no delta", base=base.manifest.version, reason=why)
        return None
    name = delta_file_name(base.manifest.version)
    listed = {f.name: f for f in base.manifest.files}
    lengths: list[DeltaFile] = []
    with open(directory / name, "wb") as out, ThreadPoolExecutor(WORKERS) as pool:
        for entry in files:
            old = listed[entry.name]
            count = len(entry.blocks.digests) if entry.blocks else 0
            frames = pool.map(
                _frame,
                [directory / entry.name] * count,
                [base.path / entry.name] * count,
                [entry] * count,
                [old] * count,
                range(count),
            )
            sizes = []
            for frame in frames:
                out.write(frame)
                sizes.append(len(frame))
            lengths.append(DeltaFile(entry.name, sizes))
        out.flush()
        os.fsync(out.fileno())
    fsync_path(directory)
    delta = Delta(base.manifest.version, base.manifest_sha256, name, lengths)
    return delta, file_entry(directory / name, digest)


def _frame(new_path: Path, old_path: Path, new: FileEntry, old: FileEntry, index: int) -> bytes:
    """Block ``index``'s frame: empty when its digest did not change, else XOR + zstd (each
    worker thread reads into, and XORs over, buffers of its own)."""
    assert new.blocks is not None and old.blocks is not None
    if new.blocks.digests[index] == old.blocks.digests[index]:
        return b""
    start, stop = new.blocks.span(index, new.bytes)
    if not hasattr(_local, "compressor"):
        _local.compressor = compressor()
        _local.buffers = (np.empty(0, np.uint8), np.empty(0, np.uint8))
    if _local.buffers[0].size < stop - start:
        _local.buffers = (np.empty(stop - start, np.uint8), np.empty(stop - start, np.uint8))
    fresh, prior = (b[: stop - start] for b in _local.buffers)
    _read_into(new_path, start, fresh)
    _read_into(old_path, start, prior)
    return encode_block(fresh, prior, _local.compressor, out=fresh)


def _read_into(path: Path, start: int, buffer: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.preadv(fd, [memoryview(buffer)], start) != buffer.size:
            raise OSError(f"{path}: shorter than its manifest says")
    finally:
        os.close(fd)
