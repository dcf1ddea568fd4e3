"""The delta of a new version from the previous one, computed while the new version is written.

Why here: the writer's pipeline (:mod:`weightcast_publisher.safetensors_writer`) holds each
16 MiB of the new version in its ring and digests its blocks; a block whose digest equals the
base's same block is unchanged and gets an empty frame without any read, and a changed block
is encoded there against the base's block (read from the base version, which the publisher
wrote minutes ago: likely still in the page cache; ``xor-sparse``, one pass over both blocks
that keeps only the changed bytes, :mod:`weightcast.contract.sparse_xor`), while the writer
thread waits on the disk. The new bytes are never read back, and no trainer time is spent.
The math is :mod:`weightcast.contract.delta`; this module finds the base, checks that its
plan is the new version's before anything is written (same tensors, same files cut into the
same blocks: else no delta), encodes each buffer's frames (:class:`FileFrames`) and writes
them in file and block order into one delta file per version (:class:`DeltaSink`), with at most the
ring's worth of frames waiting for an earlier one.

A delta is an optimisation, and never holds a publish for long: whatever goes wrong with it
(a base file shorter than its manifest, unreadable, a full disk) drops the delta, logged with
the reason, and the version is published without one. So do two budgets, checked as the
frames come: a delta whose frames hold more than ``max_ratio`` of the bytes they cover (a
version that shares little with its base: a node would read nearly all of it anyway), and a
delta whose encoding holds the write too long (the pipeline reports each wait on a buffer
only the encoding still holds: :meth:`FileFrames.behind`). How long is too long is
``publisher.delta_behind``: ``auto`` weighs both sides (:data:`AUTO_WAIT_SHARE`), ``drop``
gives up at the first wait, ``wait`` never. The encoding stops at once, and what was written
of the delta file is removed.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from weightcast.contract.delta import (
    Delta,
    DeltaFile,
    compressor,
    delta_file_name,
    encode_block,
    scratch_bytes,
)
from weightcast.contract.manifest import (
    BLOCK_BYTES,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    BlockDigests,
    FileEntry,
    Manifest,
    ManifestError,
    TensorEntry,
    new_hasher,
    sha256_bytes,
)
from weightcast.contract.version_info import dir_version, version_dir_name
from weightcast.runtime.logs import get_logger
from weightcast.runtime.stop import Stop

log = get_logger("publisher")

DROP_TOO_LARGE = "too_large"
DROP_BEHIND = "behind"
DELTA_AUTO, DELTA_DROP, DELTA_WAIT = "auto", "drop", "wait"
"""``publisher.delta_behind``: what a delta whose encoding falls behind the write does."""
AUTO_WAIT_SHARE = 1 / 3
"""``auto``, per live node: the write may wait on the encoding for up to this share of the
time it has taken so far, times the nodes that report to the registry (at least one), and
at most :data:`AUTO_WAIT_CAP`. A wait of W seconds makes every node W seconds later; a
delta saves each node a full read less a few percent, and a full read moves the bytes the
publisher writes: with one node about the write's time (a third of it is a safe bet), with N
nodes drawing on one store's bandwidth about N times that."""
AUTO_WAIT_CAP = 1.0
"""``auto``: the most the waits may add, as a share of the write's time (a publish at most
twice as long as without a delta, however many nodes)."""
AUTO_WAIT_FLOOR = 0.1
"""``auto``: seconds of waiting always allowed (a small version's write is a few buffers,
and its first waits would otherwise end the delta before the share means anything)."""
DROP_OTHER = "other"
"""Why a delta was dropped, in a word (the publisher's ``deltas_dropped`` counter's label):
it stopped paying, its encoding fell behind the write, or anything else (another plan, a base
unreadable, an error)."""
JUDGED_AFTER = 16 * 1024 * 1024
"""A delta's size is judged against ``max_ratio`` once its frames cover this many bytes (one
ring buffer), and at the end."""

_local = threading.local()
"""Each encoding thread's zstd compressor (one is not shared between threads), the buffer it
reads base blocks into and the one its frames' streams are packed in."""


@dataclass(frozen=True)
class Base:
    """The version a delta is taken from: its directory, manifest and the manifest's digest."""

    path: Path
    manifest: Manifest
    manifest_sha256: str


def find_base(weights_dir: Path, version: int) -> Base | None:
    """The newest published version below ``version`` (its ``v<N>`` directory, manifest
    readable), or None."""
    found = (dir_version(p.name) for p in weights_dir.iterdir())
    numbers = sorted((n for n in found if n is not None), reverse=True)
    for number in (n for n in numbers if n < version):
        path = weights_dir / version_dir_name(number)
        try:
            text = (path / MANIFEST_NAME).read_bytes()
            return Base(path, Manifest.from_json(text), sha256_bytes(text))
        except (OSError, ManifestError) as exc:
            log.warning("no delta base", version=number, reason=str(exc))
            return None
    return None


def same_plan(base: Manifest, tensors: Sequence[TensorEntry]) -> str:
    """Why a delta cannot be taken from ``base`` for a version of these tensors ('' when it
    can, as far as the tensors tell: :func:`same_blocks` checks each file)."""
    if base.format != MANIFEST_FORMAT:
        return f"the base is {base.format}"
    if list(base.tensors) != list(tensors):
        return "the base has other tensors (names, shapes, dtypes or shards)"
    return ""


def same_blocks(old: FileEntry | None, name: str, size: int, blocks: BlockDigests) -> str:
    """Why file ``name`` (``size`` bytes cut into ``blocks``) cannot take a delta from the
    base's entry ``old`` ('' when it can): block ``i`` must hold the same bytes in both."""
    if old is None or old.blocks is None:
        return f"{name} has no block digests in the base"
    if old.bytes != size or old.blocks.starts != blocks.starts:
        return f"{name} is cut into other blocks"
    if old.blocks.algorithm != blocks.algorithm:
        return f"{name} has {old.blocks.algorithm} digests in the base"
    return ""


def auto_wait_share(nodes: int) -> float:
    """``auto``'s share of the write's time for ``nodes`` live nodes."""
    return min(AUTO_WAIT_CAP, AUTO_WAIT_SHARE * max(1, nodes))


class DeltaSink:
    """The delta file of one version (``delta-from-v<B>.xor-sparse`` in ``directory``), fed by
    each weights file's pipeline in turn; :meth:`finish` gives its manifest entries.

    Frames are written as they become ready, in file and block order: a buffer's frames wait
    in a small reorder buffer only until the frames before them are written, so memory stays
    at the ring's size. The delta file's block digests are computed as it is written (it is
    not read back). Thread-safe: every pipeline thread calls :meth:`FileFrames.take`.
    """

    def __init__(
        self,
        directory: Path,
        base: Base,
        tensors: Sequence[TensorEntry],
        files: Sequence[str],
        digest: str,
        max_ratio: float = 0.5,
        behind: str = DELTA_AUTO,
        wait_share: float = AUTO_WAIT_SHARE,
    ) -> None:
        self.base = base
        self.max_ratio = max_ratio
        self.behind_rule = behind
        """How long the write may wait on the encoding (``delta_behind``)."""
        self.wait_share = wait_share
        """``auto``: the share of the write's time the waits may take (:func:`auto_wait_share`)."""
        self.started = time.monotonic()
        self.held = 0.0
        """Seconds the write has waited on the encoding."""
        self.path = directory / delta_file_name(base.manifest.version)
        self.expected = list(files)
        """The weights files the delta must cover, in the order they are written."""
        self.digest = digest
        self.reason = ""
        """Why there is no delta ('' while there is one)."""
        self.kind = ""
        """:data:`DROP_TOO_LARGE`, :data:`DROP_BEHIND` or :data:`DROP_OTHER` once dropped."""
        self.covered = 0
        self.encoded = 0
        """Bytes of the weights files whose frames are made, and the frames' bytes."""
        self.files: list[FileFrames] = []
        self.lock = threading.Lock()
        self.size = 0
        self.digests: list[str] = []
        self._hasher = new_hasher(digest)
        self._hashed = 0  # bytes of the delta file's current digest block
        self._out: BinaryIO | None = None
        self._finished = False
        why = same_plan(base.manifest, tensors)
        if why:
            self.drop(why, planned=True)
            return
        try:
            self._out = open(self.path, "xb")  # noqa: SIM115 (closed by finish or close)
        except OSError as exc:
            self.drop(f"cannot create {self.path.name}: {exc}")

    def file(self, name: str, size: int, blocks: BlockDigests) -> FileFrames | None:
        """The encoder of weights file ``name``'s frames, its blocks known and not yet written;
        None (and no delta for the version, logged) when the base's file differs."""
        if name not in self.expected or self.reason:
            return None
        old = next((f for f in self.base.manifest.files if f.name == name), None)
        why = same_blocks(old, name, size, blocks)
        if why:
            self.drop(why, planned=True)
            return None
        assert old is not None and old.blocks is not None
        base_path = self.base.path / name
        try:
            fd = os.open(base_path, os.O_RDONLY)
        except OSError as exc:
            self.drop(f"cannot read the base's {name}: {exc}")
            return None
        frames = FileFrames(self, name, size, blocks, old.blocks, fd)
        self.files.append(frames)
        try:
            if os.fstat(fd).st_size != old.bytes:
                self.drop(f"the base's {name} is not the {old.bytes} bytes its manifest says")
                return None
        except OSError as exc:
            self.drop(f"cannot read the base's {name}: {exc}")
            return None
        return frames

    def finish(self) -> tuple[Delta, FileEntry] | None:
        """The manifest's :class:`Delta` and the delta file's entry, the file fsynced; None
        when the delta was dropped (its file removed)."""
        try:
            with self.lock:
                done = [f.name for f in self.files if f.next_block == f.count]
                if not self.reason and done != self.expected:
                    self._drop(f"the delta covers {done}, not the weights files {self.expected}")
                self._judge(at_end=True)
                if self.reason or self._out is None:
                    return None
                if self._hashed:
                    self.digests.append(self._hasher.hexdigest())
                self._out.flush()
                os.fsync(self._out.fileno())
                self._finished = True
            base = self.base.manifest
            lengths = [DeltaFile(f.name, f.lengths) for f in self.files]
            blocks = BlockDigests(self.digest, BLOCK_BYTES, self.digests)
            delta = Delta(base.version, self.base.manifest_sha256, self.path.name, lengths)
            return delta, FileEntry(self.path.name, self.size, blocks=blocks)
        except OSError as exc:
            self.drop(f"cannot write {self.path.name}: {exc}")
            return None
        finally:
            self.close()

    def close(self) -> None:
        """Close every file; remove the delta file unless it was finished whole. Call once
        the pipelines that feed it are done."""
        for frames in self.files:
            if frames.fd >= 0:
                os.close(frames.fd)
                frames.fd = -1
        with self.lock:
            if self._out is not None:
                self._out.close()
                self._out = None
                if not self._finished:
                    self.path.unlink(missing_ok=True)

    def drop(self, reason: str, planned: bool = False, kind: str = DROP_OTHER) -> None:
        """No delta for this version, because of ``reason`` (logged once); frames that come
        after are ignored."""
        with self.lock:
            self._drop(reason, planned, kind)

    def behind(self, seconds: float) -> None:
        """The write has waited ``seconds`` more on the encoding: drop the delta when the
        waits are more than :attr:`behind_rule` allows."""
        with self.lock:
            self.held += seconds
            elapsed = time.monotonic() - self.started
            allowed = max(AUTO_WAIT_FLOOR, self.wait_share * elapsed)
            if self.behind_rule == DELTA_WAIT or (
                self.behind_rule == DELTA_AUTO and self.held <= allowed
            ):
                return
            seen = f"{self.covered} of the version's bytes encoded"
            held = f"it held the write {self.held:.3f} s of {elapsed:.3f} s"
            if self.behind_rule == DELTA_AUTO:
                held += f", over {self.wait_share:.2f} of it"
            why = f"the delta's encoding fell behind the write ({held}; {seen})"
            self._drop(why, kind=DROP_BEHIND)

    def _judge(self, at_end: bool = False) -> None:
        """Drop the delta once its frames hold more than ``max_ratio`` of the bytes they cover."""
        if self.covered < (1 if at_end else JUDGED_AFTER):
            return
        if self.encoded > self.max_ratio * self.covered:
            share = f"{self.encoded / self.covered:.0%} of the {self.covered} bytes they cover"
            why = f"the delta stopped paying: its frames hold {share} (over {self.max_ratio:g})"
            self._drop(why, kind=DROP_TOO_LARGE)

    def _drop(self, reason: str, planned: bool = False, kind: str = DROP_OTHER) -> None:
        if self.reason:
            return
        self.reason, self.kind = reason, kind
        (log.info if planned else log.warning)(
            "no delta", base=self.base.manifest.version, reason=reason
        )
        if self._out is not None:
            self._out.close()
            self._out = None
            self.path.unlink(missing_ok=True)

    def put(self, frames: FileFrames, first: int, encoded: list[bytes], covered: int) -> None:
        """The frames of blocks ``first, first + 1, ...`` of ``frames``' file (``covered``
        bytes of it): written now if every earlier frame is, else kept until they are."""
        with self.lock:
            if self.reason or self._out is None:
                return
            self.covered += covered
            self.encoded += sum(len(frame) for frame in encoded)
            self._judge()
            if self.reason:
                return
            frames.waiting[first] = encoded
            while frames.next_block in frames.waiting:
                for frame in frames.waiting.pop(frames.next_block):
                    self._write(frame)
                    frames.lengths.append(len(frame))
                    frames.next_block += 1

    def _write(self, frame: bytes) -> None:
        assert self._out is not None
        self._out.write(frame)
        self.size += len(frame)
        view = memoryview(frame)
        while view:
            take = min(len(view), BLOCK_BYTES - self._hashed)
            self._hasher.update(view[:take])
            self._hashed += take
            view = view[take:]
            if self._hashed == BLOCK_BYTES:
                self.digests.append(self._hasher.hexdigest())
                self._hasher = new_hasher(self.digest)
                self._hashed = 0


class FileFrames:
    """One weights file's frames: an optional sink of its pipeline
    (:class:`~weightcast_publisher.safetensors_writer.BufferSink`), fed each digested buffer."""

    optional = True

    def __init__(
        self,
        sink: DeltaSink,
        name: str,
        size: int,
        blocks: BlockDigests,
        base: BlockDigests,
        fd: int,
    ) -> None:
        self.sink, self.name, self.size = sink, name, size
        self.blocks, self.base, self.fd = blocks, base, fd
        self.count = len(base.digests)
        self.next_block = 0
        """The first block whose frame is not written yet."""
        self.lengths: list[int] = []
        self.waiting: dict[int, list[bytes]] = {}
        """Frames of later buffers, by their first block, until the earlier ones are written."""

    def take(self, offset: int, data: memoryview, blocks: range, digests: Sequence[str]) -> None:
        """Encode ``blocks`` (their bytes: ``data``, from file offset ``offset``; their new
        digests in ``digests``) and hand their frames on. Never raises: an error drops the
        delta."""
        try:
            encoded = []
            for index in blocks:
                if self.sink.reason:  # dropped meanwhile: stop encoding at once
                    return
                start, stop = self.blocks.span(index, self.size)
                encoded.append(
                    self._frame(index, data[start - offset : stop - offset], digests[index])
                )
            self.sink.put(self, blocks.start, encoded, len(data))
        except Exception as exc:  # a delta never fails the publish
            self.sink.drop(f"{self.name}: {exc}")

    def behind(self, seconds: float) -> None:
        """The ring has waited ``seconds`` more on a buffer the encoding still holds."""
        self.sink.behind(seconds)

    def _frame(self, index: int, new: memoryview, digest: str) -> bytes:
        """Block ``index``'s frame: empty when its digest did not change (the base is not
        read), else the block encoded against the base's, read into this thread's buffer."""
        if digest == self.base.digests[index]:
            return b""
        if not hasattr(_local, "compressor"):
            _local.compressor = compressor()
            _local.buffer = np.empty(BLOCK_BYTES, np.uint8)
            _local.scratch = np.empty(scratch_bytes(BLOCK_BYTES), np.uint8)
        base = _local.buffer[: len(new)]
        start = self.blocks.starts[index]
        done = 0
        while done < len(new):
            n = os.preadv(self.fd, [base[done:]], start + done)
            if n <= 0:
                raise OSError(f"the base's {self.name} is shorter than its manifest says")
            done += n
        return encode_block(new, base, _local.compressor, _local.scratch)


WARM_CHUNK = 16 * 1024 * 1024
"""Bytes read at a time by :func:`warm_base` (one reused buffer)."""


def warm_base(
    directory: Path, names: Sequence[str], nbytes: int, stop: Stop
) -> threading.Thread | None:
    """Read the weights files ``names`` (``nbytes`` in all) of the version just published
    back into the page cache in a background thread (``stop`` ends it early), and return
    the thread; None when they would take more than half the memory available (they would
    only push other pages, and each other, out of the cache).

    The writer writes with ``O_DIRECT``, so a version is on the disk only, and the next
    publish would read every changed block of its base from the disk it is writing to,
    inside its pipeline. Read here, between publishes, the base is in memory when the next
    version is encoded. (``posix_fadvise(WILLNEED)`` would be the cheaper ask, but the
    kernel may read only a few MiB ahead for it.) A version evicted meanwhile ends the read.
    """

    available = _available_memory()
    if nbytes > available // 2:
        log.info("base not warmed", path=str(directory), bytes=nbytes, available=available)
        return None

    def read() -> None:
        buffer = bytearray(WARM_CHUNK)
        started = time.perf_counter()
        total = 0
        for name in names:
            try:
                fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return
            try:
                offset = 0
                while not stop.is_set() and (n := os.preadv(fd, [buffer], offset)) > 0:
                    offset += n
                total += offset
            except OSError:
                return
            finally:
                os.close(fd)
        seconds = round(time.perf_counter() - started, 3)
        log.debug("base warmed", path=str(directory), bytes=total, seconds=seconds)

    thread = threading.Thread(target=read, name="weightcast-warm-base", daemon=True)
    thread.start()
    return thread


def _available_memory() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 where there is none)."""
    try:
        found = re.search(r"^MemAvailable:\s+([0-9]+) kB$", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return 0
    return int(found.group(1)) * 1024 if found else 0
