"""Reading a published version on a node: confined, verified, only the bytes a rank needs.

:class:`VersionReader` is the file side of a node, with no Redis: hand it a
:class:`~weightcast.contract.version_info.VersionInfo` (from a lease) and it

1. opens the version directory and every file without following symlinks, plain names only
   (:mod:`weightcast.store.directory`);
2. checks ``manifest.json`` against the registry's SHA-256 before parsing it, and that every
   tensor names a plain file the manifest lists (``hf/`` files are never opened);
3. plans the byte ranges the caller needs (a tensor-parallel rank: its rows of fused,
   row-parallel (format 3) and vocab-parallel tensors, replicated tensors; a format 1 or 2
   version's whole row-parallel tensors it then takes columns of; or every tensor), and the
   blocks that cover them;
4. reads those blocks (:mod:`weightcast.client.block_reads`: contiguous parts straight into
   the returned tensors, the rest through a scratch buffer), verifying each (block digests
   of format 2, or the whole-file SHA-256 of format 1) unless the node's record says a
   sibling process already did (:mod:`weightcast.client.verified`), so no byte is returned
   that was not checked.

With ``keep_base`` the reader reads the blocks into a buffer it keeps
(:class:`~weightcast.client.delta_reads.HeldBase`), returns views of it, and has one path to
the next version of the same part: the deltas from the version held to the one asked for,
one delta being a chain of one (``links``: the entries of the versions between, leased by the
caller, :mod:`weightcast.client.chains`; none when the version's own delta is from the one
held). Only the deltas' frames of the held blocks are read, applied in place link by link
(the tensors returned before become the new version), and every rebuilt block is verified
against its link's digest. One rollback rule: whatever fails once a byte has changed, every
link applied is changed back (XOR is its own inverse), so the held tensors stay bitwise the
version held. The full read is the path's base case: every first read, and every read the
deltas cannot serve (no base, another base or part, a version skipped with no chain, a chain
that does not pay, a bad frame, a digest that differs), :attr:`ReadStats.reason` saying why.

Safetensors headers are parsed defensively (:mod:`weightcast.contract.tensorfile`, the
parser the publisher uses too) after their own blocks are verified; every size is checked
before anything is allocated.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from weightcast.client.block_reads import Rect, checker, copy_rect, read_header, tensor_bytes
from weightcast.client.chains import DEFAULT_MAX_DELTA_CHAIN, chain_refusal
from weightcast.client.delta_reads import (
    DeltaApply,
    HeldBase,
    HeldFile,
    delta_refusal,
    held_block_bytes,
    held_frame_bytes,
)
from weightcast.client.verified import NodeRecord, ProcessRecord, RecordKey
from weightcast.contract.delta import Delta, DeltaError
from weightcast.contract.errors import LayoutError, WeightsError
from weightcast.contract.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    ManifestError,
    TensorEntry,
    sha256_bytes,
)
from weightcast.contract.sharding import RankSlice, rank_slice
from weightcast.contract.snapshot_format import CONFIG_NAME
from weightcast.contract.tensorfile import (
    DTYPE_SIZES,
    PREFIX_BYTES,
    TORCH_NAMES,
    HeaderError,
    TensorSpan,
    header_length,
    parse_header,
)
from weightcast.contract.untrusted import json_object
from weightcast.contract.version_info import VersionInfo
from weightcast.store.base import Store, StoredFile, StoredVersion
from weightcast.store.directory import DirectoryStore, plain_name
from weightcast.store.factory import open_store

MAX_CONFIG_BYTES = 16 * 1024 * 1024
MANIFESTS_KEPT = 8
"""Verified manifests a reader keeps parsed (a chain's links and the version), so that one
update fetches, hashes and parses each manifest once however many calls read it."""


@dataclass(frozen=True)
class Want:
    """A tensor to return: all of it (``part`` None) or one rank's part of it."""

    entry: TensorEntry
    part: RankSlice | None


@dataclass
class ReadStats:
    """What a read did: for benchmarks, tests and logs."""

    bytes_read: int = 0
    blocks_hashed: int = 0
    blocks_trusted: int = 0
    """Blocks not hashed because the node's record says they were verified already."""
    via: str = "full"
    """``delta``: rebuilt from the version held by the version's own delta (a chain of one);
    ``chain``: by the deltas of several versions in a row; ``full``: read."""
    reason: str = ""
    """Why a reader that keeps its base read the full version."""
    links: int = 0
    """The deltas applied: 1 by delta, 2 or more by chain, 0 read in full."""


def rank_wants(manifest: Manifest, tp_rank: int, tp_size: int, ep: int = 1) -> list[Want]:
    """What vLLM's tensor-parallel rank ``tp_rank`` of ``tp_size`` holds of each tensor.

    Per-rank files: that rank's entries, whole. Otherwise each tensor's
    :func:`~weightcast.contract.sharding.rank_slice` (of a mixture of experts: the rank's
    block of experts, one contiguous range). ``ep`` is the engine's expert parallelism (1, or
    ``tp_size`` with vLLM's ``enable_expert_parallel``). Raises
    :class:`~weightcast.contract.errors.LayoutError` for a placement the version cannot serve.
    """
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"rank {tp_rank} is outside tp={tp_size}")
    if manifest.ep is not None and manifest.ep != ep:
        raise LayoutError(
            f"version {manifest.version} lays its experts out for ep={manifest.ep}, not ep={ep} "
            f"(publish {'with' if ep > 1 else 'without'} --expert-parallel)"
        )
    if manifest.per_rank_files:
        if manifest.tp != tp_size:
            raise LayoutError(
                f"version {manifest.version} has per-rank files for tp={manifest.tp}, "
                f"not tp={tp_size}"
            )
        return [Want(e, None) for e in manifest.tensors if e.rank == tp_rank]
    return [
        Want(entry, rank_slice(entry.shard, entry.shape, tp_rank, tp_size))
        for entry in manifest.tensors
    ]


def whole_wants(manifest: Manifest) -> list[Want]:
    """Every tensor whole; a version split into per-rank files has no whole tensors."""
    if manifest.per_rank_files:
        raise WeightsError(
            f"{MANIFEST_NAME}: version {manifest.version} is split into per-rank files "
            "(per_rank_files); read it with rank_tensors"
        )
    return [Want(e, None) for e in manifest.tensors]


class VersionReader:
    """Verified reads of published versions in ``weights_root``, a directory, an ``s3://``
    URL or a :class:`~weightcast.store.base.Store` (see the module doc).

    ``verified_dir``: a node-local directory shared by this node's reader processes (its
    vLLM workers) so that each block is verified once per node and version; None keeps the
    record in this process only.
    """

    def __init__(
        self,
        weights_root: Path | str | Store,
        verified_dir: Path | str | None = None,
        keep_base: bool = False,
        store_retry_seconds: float = 60.0,
        max_delta_chain: int = DEFAULT_MAX_DELTA_CHAIN,
    ) -> None:
        self.store = open_store(weights_root, store_retry_seconds)
        self._owns_store = not isinstance(weights_root, Store)
        """A store handed in is its giver's to close; one opened here is this reader's."""
        self.record = ProcessRecord() if verified_dir is None else NodeRecord(verified_dir)
        self.stats = ReadStats()
        """What the last read to finish did."""
        self.keep_base = keep_base
        if keep_base:
            # The delta kernels now, not inside the first update; numba is imported only
            # here (some 60 MB and 0.2 s a reader that keeps no base does without).
            from weightcast.contract.sparse_xor import compile_kernels

            compile_kernels()
        self.base: HeldBase | None = None
        """The verified blocks of the last version read (``keep_base``): a delta's base."""
        self.max_delta_chain = max_delta_chain
        """Deltas applied in a row at most (a chain of ``links``)."""
        self._manifests: OrderedDict[tuple[str, str], Manifest] = OrderedDict()
        """Manifests read and checked, by path and the registry's SHA-256 of them."""

    def path(self, info: VersionInfo) -> Path:
        """Where the version is on this node's filesystem (inside the weights root, or a
        WeightsError); only for a directory store."""
        if not isinstance(self.store, DirectoryStore):
            raise WeightsError(f"{self.store.label} is no directory; versions have no path here")
        return self.store.path(info.path)

    def close(self) -> None:
        """Release the store's connections (a store handed in stays open: its giver's)."""
        if self._owns_store:
            self.store.close()

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
            return json_object(data, f"{directory.label}/{CONFIG_NAME}", WeightsError)

    def verify(self, info: VersionInfo) -> Manifest:
        """Check everything a node reads of the version: the manifest, ``config.json`` and
        every block of every file its tensors are in."""
        self.config(info)
        stats = ReadStats()
        with self._open(info) as directory:
            manifest = self._manifest(directory, info)
            for name in sorted({t.file for t in manifest.tensors}):
                entry = _file_entry(manifest, name)
                with directory.open(name, entry.bytes) as f:
                    self._read_file(f, _key(info), entry, [], stats, everything=True)
        self.stats = stats
        return manifest

    def load(self, info: VersionInfo, links: Sequence[VersionInfo] = ()) -> dict[str, torch.Tensor]:
        """Every tensor of the version, whole and verified (``links``: as for
        :meth:`rank_tensors`)."""
        return self._read(info, whole_wants, ("whole",), links)

    def rank_tensors(
        self,
        info: VersionInfo,
        tp_rank: int,
        tp_size: int,
        ep: int = 1,
        links: Sequence[VersionInfo] = (),
    ) -> dict[str, torch.Tensor]:
        """What vLLM's rank ``tp_rank`` of ``tp_size`` holds of each tensor, verified.

        Only the blocks covering that rank's byte ranges are read and verified (of a format 1
        or 2 version, a whole row-parallel tensor, whose columns are the rank's part;
        per-rank files: that rank's file). Raises
        :class:`~weightcast.contract.errors.LayoutError` for a ``tp_size`` the version was not
        fused for (or experts laid out for another ``ep``), :class:`WeightsError` for anything
        wrong on disk.

        ``links``: the registry entries of the versions between the one held (``keep_base``)
        and ``info``'s, oldest first, each one's delta from the one before, leased by the
        caller while this runs (live or delta-only versions): their deltas are applied one
        after the other when together they read fewer bytes than the full version.
        """
        return self._read(
            info,
            lambda manifest: rank_wants(manifest, tp_rank, tp_size, ep),
            ("rank", tp_rank, tp_size, ep),
            links,
        )

    def _read(
        self,
        info: VersionInfo,
        plan: Callable[[Manifest], list[Want]],
        part: tuple[object, ...],
        links: Sequence[VersionInfo] = (),
    ) -> dict[str, torch.Tensor]:
        """The one read path: a keeping reader's by the deltas from the version it holds to
        ``info``'s (``links``' then ``info``'s own: one delta is a chain of one), else the
        full read, which is also every first read and every read of a reader keeping none."""
        stats = ReadStats()
        with self._open(info) as directory:
            manifest = self._manifest(directory, info)
            by_file: dict[str, list[Want]] = {}
            for want in plan(manifest):
                by_file.setdefault(want.entry.file, []).append(want)
            if self.keep_base:
                tensors = self._read_by_deltas(
                    info, links, directory, manifest, by_file, part, stats
                )
                if tensors is not None:
                    assert self.base is not None
                    self.base = HeldBase(
                        info.version, info.manifest_sha256, manifest, part, self.base.files
                    )
                    stats.via = "delta" if stats.links == 1 else "chain"
                    self.stats = stats
                    return tensors
                stats = ReadStats(reason=stats.reason)
            tensors = self._read_full(info, directory, manifest, by_file, part, stats)
        self.stats = stats
        return tensors

    def _read_full(
        self,
        info: VersionInfo,
        directory: StoredVersion,
        manifest: Manifest,
        by_file: dict[str, list[Want]],
        part: tuple[object, ...],
        stats: ReadStats,
    ) -> dict[str, torch.Tensor]:
        """The wanted tensors read from the version's own files; a keeping reader's base is
        then their blocks."""
        # A full read replaces the base: let go of it first, so that a node holds one
        # version at a time (at 8B, not 32 GB). Should the read fail, the next one is full.
        self.base = None
        held = HeldBase(info.version, info.manifest_sha256, manifest, part)
        tensors = {}
        for name, file_wants in by_file.items():
            entry = _file_entry(manifest, name)
            with directory.open(name, entry.bytes) as f:
                got, kept = self._read_file(
                    f, _key(info), entry, file_wants, stats, keep=self.keep_base
                )
            tensors |= got
            if kept is not None:
                held.files[name] = kept
        if self.keep_base:
            self.base = held
        return tensors

    def _read_by_deltas(
        self,
        info: VersionInfo,
        links: Sequence[VersionInfo],
        directory: StoredVersion,
        manifest: Manifest,
        by_file: dict[str, list[Want]],
        part: tuple[object, ...],
        stats: ReadStats,
    ) -> dict[str, torch.Tensor] | None:
        """The wanted tensors, the base's held blocks turned into ``info``'s in place by the
        deltas of ``links`` then ``info``'s own (:meth:`_apply`); None when they are not
        (``stats.reason`` says why; the caller reads the full version).

        Checked before a held byte changes: that the node holds this part; every link's
        manifest against its registry digest; each delta from the version before it (number
        and manifest digest; the first from the version held); the node holding the blocks
        of every file the part is in; and for a chain of several, that it reads fewer bytes
        than this part read whole (a single delta was judged by its publisher). A refusal is
        its reason (a link's after ``link N:``); a failure (a link that cannot be opened, a
        damaged delta, a block whose digest differs) is ``the delta failed: ...``, or ``the
        delta chain failed: ...``."""
        base = self.base
        if base is None:
            stats.reason = "the node holds no earlier version"
            return None
        if part != base.wants:
            stats.reason = "the node holds another part of the base (another rank or tp)"
            return None
        try:
            with ExitStack() as stack:
                steps: list[tuple[StoredVersion, Manifest]] = []
                before = (base.version, base.manifest_sha256)
                for link in (*links, info):
                    step = (directory, manifest) if link is info else self._link(stack, link)
                    why = delta_refusal(link.version, step[1], before, held=not steps)
                    if why:
                        stats.reason = why if link is info else f"link {link.version}: {why}"
                        return None
                    steps.append(step)
                    before = (link.version, link.manifest_sha256)
                held: dict[str, HeldFile] = {}
                for name in by_file:
                    if name not in base.files:
                        raise DeltaError(f"the node holds no block of {name}")
                    held[name] = base.files[name]
                if len(steps) > 1:
                    sizes = [
                        sum(held_frame_bytes(_delta(m), n, held[n]) for n in held) for _, m in steps
                    ]
                    full = sum(held_block_bytes(h) for h in held.values())
                    stats.reason = chain_refusal(sizes, full, self.max_delta_chain)
                    if stats.reason:
                        return None
                return self._apply(base.manifest, steps, held, by_file, stats)
        except DeltaError as exc:
            stats.reason = f"the delta{' chain' if links else ''} failed: {exc}"
            return None

    def _link(self, stack: ExitStack, link: VersionInfo) -> tuple[StoredVersion, Manifest]:
        """A chain link's files, open until ``stack`` closes, and its checked manifest; a
        link that cannot be opened or whose manifest is not the registry's fails the chain
        (:class:`DeltaError`), not the version."""
        try:
            opened = stack.enter_context(self._open(link))
            return opened, self._manifest(opened, link)
        except WeightsError as exc:
            raise DeltaError(f"link {link.version}: {exc}") from None

    def _apply(
        self,
        base: Manifest,
        steps: Sequence[tuple[StoredVersion, Manifest]],
        held: dict[str, HeldFile],
        by_file: dict[str, list[Want]],
        stats: ReadStats,
    ) -> dict[str, torch.Tensor]:
        """The held blocks turned, link by link, from ``base``'s version into the last
        step's, in place (:class:`~weightcast.client.delta_reads.DeltaApply`: every rebuilt
        block verified against its link's digest), and the wanted tensors out of them (the
        headers parsed from the rebuilt blocks, every part checked against them).

        The rollback rule, for one delta as for a chain: whatever fails from the first byte
        changed to the last tensor taken (a frame, a digest, the version's header or a tensor
        part), every block changed by every link is changed back, last link first (XOR is
        its own inverse, from the frames already read), before the error is raised: the held
        tensors are bitwise the version held. A :class:`DeltaError` then reads the full
        version; a :class:`WeightsError` (a header or tensor the version's own digests vouch
        for) refuses it."""
        applied: list[DeltaApply] = []
        try:
            previous = base
            for step_dir, step_manifest in steps:
                delta = _delta(step_manifest)
                files = [
                    (_file_entry(step_manifest, n), _file_entry(previous, n), held[n]) for n in held
                ]
                with _delta_file(step_dir, step_manifest, delta) as frames:
                    change = DeltaApply(delta, frames, files)
                    stats.bytes_read += change.apply()  # reverts its own blocks on failure
                applied.append(change)
                previous = step_manifest
            directory, manifest = steps[-1]
            tensors: dict[str, torch.Tensor] = {}
            for name, file in held.items():
                label = f"{directory.label}/{name}"
                size = _file_entry(manifest, name).bytes
                spans = _header_spans(partial(_held_bytes, file), size, label)
                parts = [_part(want, spans, label) for want in by_file[name]]
                tensors |= _held_tensors(file, parts, label)
                stats.blocks_hashed += len(file.offsets) * len(steps)
        except BaseException:
            for change in reversed(applied):
                change.revert()
            raise
        stats.links = len(steps)
        return tensors

    @contextmanager
    def _open(self, info: VersionInfo) -> Iterator[StoredVersion]:
        """The version's files, open while the caller reads them. Running out of memory on
        what the version's files or entry hold is the version's refusal (a WeightsError that
        a node logs before it waits for the next version), not a crash."""
        try:
            with self.store.open_version(info.path) as directory:
                yield directory
        except MemoryError:
            raise WeightsError(
                f"{self.store.label}/{info.path}: reading version {info.version} needs more "
                "memory than this node has; refusing it (check the version's files, or give "
                "the node more memory)"
            ) from None

    def _manifest(self, directory: StoredVersion, info: VersionInfo) -> Manifest:
        """The manifest, checked against the registry's digest: read once per path and
        digest (the digest pins its content), then kept parsed."""
        key = (info.path, info.manifest_sha256)
        manifest = self._manifests.get(key)
        if manifest is None:
            manifest = self._read_manifest(directory, info)
            self._manifests[key] = manifest
            if len(self._manifests) > MANIFESTS_KEPT:
                self._manifests.popitem(last=False)
        return manifest

    def _read_manifest(self, directory: StoredVersion, info: VersionInfo) -> Manifest:
        label = f"{directory.label}/{MANIFEST_NAME}"
        data = directory.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES)
        if sha256_bytes(data) != info.manifest_sha256:
            raise WeightsError(f"{label}: sha256 differs from the registry's manifest_sha256")
        try:
            manifest = Manifest.from_json(data)
        except ManifestError as exc:
            raise WeightsError(f"{label}: not a valid manifest ({exc})") from None
        check_node_manifest(manifest, label)
        return manifest

    def _read_file(
        self,
        f: StoredFile,
        key: RecordKey,
        entry: FileEntry,
        wants: Sequence[Want],
        stats: ReadStats,
        everything: bool = False,
        keep: bool = False,
    ) -> tuple[dict[str, torch.Tensor], HeldFile | None]:
        """The wanted tensors of one open file, out of verified blocks only: contiguous parts
        are read straight into their tensors, column blocks copied out of verified windows.
        ``keep`` (files with block digests): every block read, the header's too, goes to a
        :class:`~weightcast.client.delta_reads.HeldFile` (a delta's base, returned too), and
        the tensors are views of it."""
        check = checker(entry, self.record.known(key, entry.name, f.identity), f.label)
        spans = read_header(f, check)
        parts = [_part(want, spans, f.label) for want in wants]
        held = outputs = None
        if everything:
            blocks: Iterable[int] = range(check.block_count)
        elif keep and entry.blocks is not None:
            header = (0, _data_start(spans, f.size))
            blocks = check.needed([header, *(p.rect.extent for p in parts)])
            held = HeldFile.allocate(check.starts, blocks)
        else:
            blocks = check.needed(p.rect.extent for p in parts)
        if held is not None:
            for _ in check.read(f, blocks, held.runs()):
                pass
        else:
            # On the CPU whatever the default device: preadv writes into these addresses.
            outputs = {p.name: torch.empty(p.shape, dtype=p.dtype, device="cpu") for p in parts}
            direct = sorted(
                (p.rect.offset, tensor_bytes(outputs[p.name])) for p in parts if p.rect.rows == 1
            )
            columns = [p for p in parts if p.rect.rows > 1]
            for window in check.read(f, blocks, direct):
                for p in columns:
                    flat = outputs[p.name].view(-1).view(torch.uint8)
                    copy_rect(p.rect, window.start, window.scratch, flat)
        check.finish()
        stats.bytes_read += check.bytes_read
        stats.blocks_hashed += check.hashed
        stats.blocks_trusted += check.trusted
        self.record.add(key, entry.name, f.identity, check.verified)
        if held is not None:
            return _held_tensors(held, parts, f.label), held
        assert outputs is not None
        return outputs, None


def check_node_manifest(manifest: Manifest, label: str) -> None:
    """What a node relies on before opening any file the manifest names."""
    listed = {f.name for f in manifest.files}
    if CONFIG_NAME not in listed:
        raise WeightsError(f"{label}: lists no {CONFIG_NAME}")
    names = [(t.name, t.rank) for t in manifest.tensors]
    if len(set(names)) != len(names):
        raise WeightsError(f"{label}: lists a tensor twice")
    for t in manifest.tensors:
        plain_name(t.file, f"{label}: tensor {t.name} names the file")
        if t.file not in listed:
            raise WeightsError(
                f"{label}: tensor {t.name} is in {t.file!r}, a file the manifest does not list"
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


def _data_start(spans: dict[str, TensorSpan], size: int) -> int:
    """Where the header ends: the first tensor's first byte (the file's end if none)."""
    return min((span.start for span in spans.values()), default=size)


def _held_tensors(held: HeldFile, parts: Sequence[_Part], label: str) -> dict[str, torch.Tensor]:
    """The parts out of a file's held blocks: views where a part is contiguous (it changes
    with them: the next delta read updates it in place), copies of column blocks; a
    :class:`DeltaError` if a byte they need is not held."""
    outputs = {}
    runs = held.runs() if any(p.rect.rows > 1 for p in parts) else []
    for p in parts:
        first, last = p.rect.extent
        if p.rect.rows == 1:
            data = held.span(first, last)
            if data is None:
                raise DeltaError(f"{label}: the node holds no block of {p.name}")
            outputs[p.name] = data.view(p.dtype).view(p.shape)
            continue
        # On the CPU whatever the default device, as every read.
        out = torch.empty(p.shape, dtype=p.dtype, device="cpu")
        for start, data in runs:
            copy_rect(p.rect, start, data, out.view(-1).view(torch.uint8))
        outputs[p.name] = out
    return outputs


def _held_bytes(held: HeldFile, start: int, stop: int) -> bytes | None:
    """File bytes ``[start, stop)`` of the blocks held, or None when one is not held."""
    data = held.span(start, stop)
    return None if data is None else data.numpy().tobytes()


def _header_spans(
    span: Callable[[int, int], bytes | None], size: int, label: str
) -> dict[str, TensorSpan]:
    """A file's tensors by name, from its header: ``span(start, stop)`` gives its verified
    bytes (None: a block of them is not held, a :class:`DeltaError`)."""
    try:
        prefix = span(0, min(PREFIX_BYTES, size))
        if prefix is None:
            raise DeltaError(f"{label}: the node holds no block of its header")
        stop = PREFIX_BYTES + header_length(prefix, size, label)
        head = span(PREFIX_BYTES, stop)
        if head is None:
            raise DeltaError(f"{label}: the node holds no block of its header")
        header = parse_header(head, size, label)
    except HeaderError as exc:
        raise WeightsError(str(exc)) from None
    return {span.name: span for span in header.tensors}


def _delta(manifest: Manifest) -> Delta:
    """The delta of a link that :func:`~weightcast.client.delta_reads.delta_refusal` let
    pass (it has one)."""
    assert manifest.delta is not None
    return manifest.delta


def _delta_file(directory: StoredVersion, manifest: Manifest, delta: Delta) -> StoredFile:
    """The delta file, opened; one that is missing or not the size the manifest lists is a
    damaged delta (the node reads the full version), not a refused version."""
    try:
        return directory.open(delta.file, _file_entry(manifest, delta.file).bytes)
    except WeightsError as exc:
        raise DeltaError(str(exc)) from None


# -- what to read ------------------------------------------------------------------------


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
    if span is None or list(span.shape) != entry.shape or TORCH_NAMES[span.dtype] != entry.dtype:
        raise WeightsError(
            f"{label}: tensor {entry.name} is missing or not {entry.dtype} {entry.shape}"
        )
    dtype: torch.dtype = getattr(torch, entry.dtype)
    item, shape = DTYPE_SIZES[span.dtype], span.shape
    if part is not None and part.start == 0 and part.stop == shape[part.dim]:
        part = None  # all of it (tp 1): one contiguous range, read straight into the tensor
    if part is None:
        return _Part(entry.name, dtype, shape, Rect(span.start, 1, 0, span.nbytes))
    if not 0 <= part.start <= part.stop <= shape[part.dim]:
        # Every returned byte must lie in the tensor's own verified blocks: never past it.
        raise WeightsError(f"{label}: tensor {entry.name} {list(shape)} has no part {part}")
    count = part.stop - part.start
    if part.dim == 0:
        row = math.prod(shape[1:]) * item
        rect = Rect(span.start + part.start * row, 1, 0, count * row)
        return _Part(entry.name, dtype, (count, *shape[1:]), rect)
    if part.dim == 1 and len(shape) == 2:
        rect = Rect(span.start + part.start * item, shape[0], shape[1] * item, count * item)
        return _Part(entry.name, dtype, (shape[0], count), rect)
    raise WeightsError(f"{label}: tensor {entry.name} {list(shape)} cannot be split along dim 1")
