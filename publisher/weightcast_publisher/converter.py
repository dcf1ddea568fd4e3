"""Snapshot -> a version's files: source, plan, write, in that order.

:func:`write_version` is the publish path's writer in one place: open the snapshot's source
(:func:`~weightcast_publisher.sources.open_source`: byte ranges from the safetensors
headers, or ``dcp.load``), plan the version (:func:`weightcast.contract.plan.plan_version`,
pure), write each planned file (:mod:`weightcast_publisher.safetensors_writer`: copy, digest
per block, check floats; and, when the previous version has the same plan, encode the delta
from it on the way: :mod:`weightcast_publisher.delta_writer`) and the JSON files, then the
manifest, all into the directory the store's write hands out; the store makes it ``v<N>/``
(:class:`~weightcast.store.directory.DirectoryWrite`: a ``v*`` directory is always whole).
Fused files are named ``*.vllm-fused`` and their ``config.json`` names the marker
architecture (:func:`~weightcast.contract.layout.fused_config`), so stock vLLM refuses them
instead of loading them wrong. A snapshot file that already is an HF file the plan asks for
(one rank, every tensor whole) is linked into the version instead of copied; it is still read
once for its digests. The caller (:mod:`~weightcast_publisher.publishing`) finishes the
version in the publisher's store and registers it; :func:`convert` writes and finishes one in
a weights directory alone (tests, benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcast.contract.delta import Delta
from weightcast.contract.errors import BlockCutError, LayoutError
from weightcast.contract.experts import check_placement
from weightcast.contract.fp8 import QUANTIZE_FP8, QUANTIZE_NONE, quantized_config
from weightcast.contract.fusion import check_tp
from weightcast.contract.layout import LAYOUT_HF, LAYOUT_VLLM_FUSED, fused_config
from weightcast.contract.manifest import (
    DEFAULT_DIGEST,
    MANIFEST_NAME,
    MIXED_DTYPE,
    FileEntry,
    Manifest,
    TensorEntry,
    file_entry,
    sha256_bytes,
)
from weightcast.contract.model_shape import ModelShape, check_shapes
from weightcast.contract.plan import PlannedFile, PlannedTensor, VersionPlan, plan_version
from weightcast.contract.sharding import ShardKind, rank_slice
from weightcast.contract.snapshot_format import CONFIG_NAME
from weightcast.contract.tensorfile import TORCH_NAMES
from weightcast.contract.version_info import version_dir_name
from weightcast.runtime.durable import write_bytes, write_json
from weightcast.store.base import LocalVersionWrite, VersionWrite
from weightcast.store.directory import DirectoryStore
from weightcast.store.mirror import MirroredWrite
from weightcast_publisher.delta_writer import (
    AUTO_WAIT_SHARE,
    DELTA_AUTO,
    DeltaSink,
    find_base,
)
from weightcast_publisher.quantized_source import QuantizedSource
from weightcast_publisher.safetensors_writer import (
    NonFiniteTensor,
    OutputTensor,
    SourceEnded,
    digest_file,
    link_file,
    write_safetensors,
)
from weightcast_publisher.snapshot_scan import CorruptSnapshot, Snapshot, read_config
from weightcast_publisher.sources import READER_AUTO, Source, open_source

HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    tp: int = 1
    layout: str = LAYOUT_VLLM_FUSED
    per_rank_files: bool = False
    reader: str = READER_AUTO
    """``auto``: byte ranges when the snapshot allows, else ``dcp.load``; ``dcp-load``: always."""
    digest: str = DEFAULT_DIGEST
    delta: bool = True
    """Write a delta from the newest earlier version beside the version, computed as the
    version is written, when their plans match (:mod:`weightcast_publisher.delta_writer`)."""
    expert_parallel: bool = False
    """A mixture of experts' experts laid out whole per rank (vLLM's ``enable_expert_parallel``,
    ep = tp) instead of each expert split over the ranks (ep = 1)."""
    delta_max_ratio: float = 0.5
    """Drop the delta once its frames hold more than this fraction of the bytes they cover."""
    delta_behind: str = DELTA_AUTO
    """How long the write may wait on the delta's encoding: ``auto`` (a share of the
    write's time), ``drop`` (not at all) or ``wait`` (as long as it takes)."""
    delta_wait_share: float = AUTO_WAIT_SHARE
    """``auto``'s share of the write's time (the daemon's follows the live nodes)."""
    quantize: str = QUANTIZE_NONE
    """``fp8``: linear weights as block-scaled FP8 with their scales
    (:mod:`weightcast.contract.fp8`); ``none``: as the snapshot holds them."""

    @property
    def ep(self) -> int:
        return self.tp if self.expert_parallel else 1


@dataclass(frozen=True)
class ConvertedVersion:
    """A version written (and its weights files sent, to a store that takes them as they are
    written) but not registered yet."""

    path: Path
    """Its directory in the weights directory once finished (``v<N>/``)."""
    manifest: Manifest
    manifest_sha256: str
    reader: str
    linked: int = 0
    """Files linked from the snapshot instead of copied."""
    no_delta: str = ""
    """Why the version has no delta although it had a base ('' when it has one, or no base)."""
    no_delta_kind: str = ""
    """That reason in a word (``delta_writer.DROP_*``)."""


def convert(
    snapshot: Snapshot,
    weights_dir: Path,
    version: int,
    options: ConvertOptions | None = None,
    store: VersionWrite | None = None,
) -> ConvertedVersion:
    """Write ``snapshot`` as version ``version`` in the weights directory ``weights_dir`` and
    finish it there (``v<N>/``); its weights files also to ``store`` (the version begun in a
    bucket) as they are written: the rest is the caller's to send. Whatever fails aborts
    ``store``'s version too. (The publisher writes through its store: :func:`write_version`.)
    """
    local = DirectoryStore(weights_dir).begin_version(version_dir_name(version))
    write = local if store is None else MirroredWrite(local, store)
    written = write_version(snapshot, write, version, options)
    try:
        local.finish(local.directory)
    except BaseException:
        write.abort()
        raise
    return written


def write_version(
    snapshot: Snapshot,
    write: LocalVersionWrite,
    version: int,
    options: ConvertOptions | None = None,
) -> ConvertedVersion:
    """Write ``snapshot`` as version ``version`` in the directory ``write`` hands out
    (``write.directory``), each weights file's parts handed to the store as they are written
    (``write.file``), the manifest last; the delta's base is the newest earlier version beside
    ``write.final``. Finishing it in the store is the caller's (``write.finish``).

    Raises :class:`CorruptSnapshot` for a snapshot that cannot be published (the daemon
    quarantines it), LayoutError for a tp vLLM would refuse for this model (the setting is
    wrong, not the snapshot). Whatever fails aborts ``write``: nothing of the version is left,
    written or sent.
    """
    options = options or ConvertOptions()
    tmp = write.directory
    sink: DeltaSink | None = None
    try:
        config = read_config(snapshot)
        source: Source = open_source(snapshot, options.reader)
        if options.quantize == QUANTIZE_FP8:
            source, config = QuantizedSource(source), quantized_config(config)
        plan = _plan(source, config, options)
        if options.delta:
            sink = _delta_sink(write.final.parent, tmp, version, plan, options)
        files, linked = _write_files(tmp, plan, source, config, options.digest, sink, write)
        delta = sink.finish() if sink is not None else None
        if delta is not None:
            files.append(delta[1])
        manifest = _manifest(snapshot, version, plan, files, delta and delta[0])
        manifest_json = manifest.to_json().encode()
        write_bytes(tmp / MANIFEST_NAME, manifest_json)
    except BaseException as exc:
        if sink is not None:
            sink.close()
        write.abort()
        if isinstance(exc, NonFiniteTensor):
            raise CorruptSnapshot(f"non-finite weights: {exc}") from None
        if isinstance(exc, SourceEnded):
            raise CorruptSnapshot(f"a data file is shorter than its header says: {exc}") from None
        raise
    dropped = ("", "") if sink is None else (sink.reason, sink.kind)
    return ConvertedVersion(
        write.final, manifest, sha256_bytes(manifest_json), source.kind, linked, *dropped
    )


def _plan(source: Source, config: dict[str, Any], options: ConvertOptions) -> VersionPlan:
    """The version's plan; what the snapshot's tensors contradict is a corrupt snapshot."""
    try:
        shape = ModelShape.from_hf_config(config)
        check_shapes({name: size for name, (_, size) in source.tensors.items()}, shape)
    except LayoutError as exc:
        raise CorruptSnapshot(str(exc)) from None
    check_tp(shape, options.tp)  # a tp the model cannot take: the setting is wrong
    check_placement(shape, options.tp, options.ep)
    try:
        return plan_version(
            source.tensors, shape, options.tp, options.layout, options.per_rank_files, options.ep
        )
    except BlockCutError:
        raise  # a tp that cuts FP8 scale blocks: the setting is wrong
    except LayoutError as exc:
        raise CorruptSnapshot(str(exc)) from None


def _write_files(
    tmp: Path,
    plan: VersionPlan,
    source: Source,
    config: dict[str, Any],
    digest: str,
    sink: DeltaSink | None = None,
    store: VersionWrite | None = None,
) -> tuple[list[FileEntry], int]:
    """Every file of the version, in ``tmp``; their manifest entries and how many linked.
    The listed weights files feed ``sink``, the delta; the written ones ``store``."""
    if plan.hf_dir:
        (tmp / plan.hf_dir).mkdir()
    files = [_write(tmp, planned, source, digest, plan.tp, sink, store) for planned in plan.fused]
    linked = 0
    hf_sink = None if plan.fused else sink
    for planned in plan.hf:
        entry = _link(tmp, planned, source, digest, hf_sink)
        linked += entry is not None
        files.append(entry or _write(tmp, planned, source, digest, 1, hf_sink, store))
    if plan.hf:
        hf_dir = f"{plan.hf_dir}/" if plan.hf_dir else ""
        weight_map = dict(sorted(plan.hf_index.items()))
        total = sum(t.nbytes for f in plan.hf for t in f.tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        files.append(_json_file(tmp, hf_dir + HF_INDEX, index, digest))
        if plan.hf_dir:
            files.append(_json_file(tmp, hf_dir + CONFIG_NAME, config, digest))
    top_config = config if plan.layout == LAYOUT_HF else fused_config(config)
    files.append(_json_file(tmp, CONFIG_NAME, top_config, digest))
    return files, linked


def _write(
    tmp: Path,
    planned: PlannedFile,
    source: Source,
    digest: str,
    tp: int = 1,
    sink: DeltaSink | None = None,
    store: VersionWrite | None = None,
) -> FileEntry:
    """Write ``planned`` (to the store too, part by part, when it takes the file's parts);
    with ``tp`` > 1 its blocks are cut between the ranks' rows."""
    outputs = [
        OutputTensor(
            t.name,
            t.dtype,
            t.shape,
            tuple(p for r in t.regions for p in source.pieces(r)),
            rank_rows(t, tp),
        )
        for t in planned.tensors
    ]
    upload = store.file(planned.name) if store is not None else None
    entry = write_safetensors(tmp / planned.name, outputs, digest, planned.name, sink, upload)
    if upload is not None:
        upload.complete()
    return entry


def rank_rows(tensor: PlannedTensor, tp: int) -> tuple[tuple[int, int], ...]:
    """The byte range of ``tensor`` that each of ``tp`` ranks reads, by rank, when ranks
    read their own rows of it (:func:`~weightcast.contract.sharding.rank_slice` along dim 0);
    empty when every rank reads all of it (replicated, or columns: every row is read)."""
    if tp == 1 or tensor.rank is not None or tensor.shard.kind == ShardKind.HF:
        return ()
    row = tensor.nbytes // tensor.shape[0] if tensor.shape and tensor.shape[0] else 0
    ranges = []
    for rank in range(tp):
        part = rank_slice(tensor.shard, tensor.shape, rank, tp)
        if part is None or part.dim != 0:
            return ()
        ranges.append((part.start * row, part.stop * row))
    return tuple(ranges)


def _link(
    tmp: Path, planned: PlannedFile, source: Source, digest: str, sink: DeltaSink | None
) -> FileEntry | None:
    """Link the snapshot's file that already is ``planned``; None when there is none or
    the filesystem cannot link it (then it is copied). Its one read feeds ``sink``."""
    found = source.whole_file(planned)
    if found is None:
        return None
    path, spans = found
    target = tmp / planned.name
    if not link_file(path, target):
        return None
    return digest_file(target, spans, digest, planned.name, sink)


def _json_file(tmp: Path, name: str, data: object, digest: str) -> FileEntry:
    write_json(tmp / name, data)
    entry = file_entry(tmp / name, digest)
    return FileEntry(name, entry.bytes, blocks=entry.blocks)


def _delta_sink(
    weights_dir: Path, tmp: Path, version: int, plan: VersionPlan, options: ConvertOptions
) -> DeltaSink | None:
    """The delta from the newest earlier version, to be fed as the version is written in
    ``tmp``; None when there is no earlier version."""
    base = find_base(weights_dir, version)
    if base is None:
        return None
    names = [f.name for f in plan.listed]
    return DeltaSink(
        tmp,
        base,
        _tensors(plan),
        names,
        options.digest,
        options.delta_max_ratio,
        behind=options.delta_behind,
        wait_share=options.delta_wait_share,
    )


def _tensors(plan: VersionPlan) -> list[TensorEntry]:
    return [
        TensorEntry(t.name, f.name, list(t.shape), TORCH_NAMES[t.dtype], t.shard, t.rank)
        for f in plan.listed
        for t in f.tensors
    ]


def _manifest(
    snapshot: Snapshot,
    version: int,
    plan: VersionPlan,
    files: list[FileEntry],
    delta: Delta | None = None,
) -> Manifest:
    tensors = _tensors(plan)
    dtypes = {t.dtype for t in tensors}
    return Manifest(
        version=version,
        step=snapshot.step,
        run_id=snapshot.info.run_id,
        snapshot_id=snapshot.info.snapshot_id,
        layout=LAYOUT_HF if plan.layout == LAYOUT_HF else LAYOUT_VLLM_FUSED,
        tp=plan.tp,
        dtype=dtypes.pop() if len(dtypes) == 1 else MIXED_DTYPE,
        files=files,
        tensors=tensors,
        per_rank_files=plan.per_rank_files,
        hf_dir=plan.hf_dir,
        ep=plan.ep,
        delta=delta,
    )
