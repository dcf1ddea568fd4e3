"""Snapshot -> version directory, streamed as byte ranges and written atomically.

Everything goes to ``.tmp-v<N>/`` (safetensors, ``config.json``, ``manifest.json``), is
fsynced, and only then renamed to ``v<N>/``: a ``v*`` directory is always whole. Tensors are
never materialised on the byte-range path: the writer copies row blocks from the snapshot's
DCP files to their place in the output (see :mod:`publisher.safetensors_writer`). Snapshots
whose storage that path does not recognise are loaded with ``dcp.load`` and written through
the same writer, so both paths give the same bytes.

Layouts (``--layout``):

* ``vllm-fused`` (default): ``model.vllm-fused`` with fused ``qkv_proj`` / ``gate_up_proj``
  for one tp, or with ``--per-rank-files`` (tp > 1) one ``model-rank-RR-of-TT.vllm-fused``
  per rank holding exactly what ``layout.rank_slice`` gives that rank, and no whole file.
  Both are safetensors files; their names, and the marker architecture in ``config.json``
  (``layout.fused_config``), keep stock vLLM from loading them wrong.
* ``hf``: the plain HF layout in ``v<N>/`` itself: ``model-0000i-of-0000n.safetensors``,
  ``model.safetensors.index.json`` and ``config.json``, what transformers, SGLang and stock
  vLLM read.
* ``both``: the fused layout in ``v<N>/`` and the HF layout in ``v<N>/hf/``; the manifest's
  tensors are the fused ones, its files list both (``hf/...`` names), ``hf_dir`` says where.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weightcast.contract.durable import fsync_path, publish_dir, write_bytes, write_json
from weightcast.contract.layout import (
    FUSED_WEIGHTS_FILE,
    LAYOUT_HF,
    LAYOUT_VLLM_FUSED,
    FusedTensor,
    LayoutError,
    ModelShape,
    check_shapes,
    check_tp,
    fused_config,
    fused_rank_file,
    plan_vllm_fused,
    rank_slice,
)
from weightcast.contract.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    TensorEntry,
    file_entry,
    sha256_bytes,
)
from weightcast.contract.snapshots import CONFIG_NAME
from weightcast.publisher.dcp_index import Unsupported, check_sizes, index_snapshot
from weightcast.publisher.safetensors_writer import (
    OutputTensor,
    Piece,
    SourceEnded,
    write_safetensors,
)
from weightcast.publisher.snapshot_reader import (
    CorruptSnapshot,
    Snapshot,
    load_tensors,
    read_config,
    read_metadata,
)
from weightcast.publisher.sources import DcpSource, MemorySource, Source

WEIGHTS_FILE = FUSED_WEIGHTS_FILE
HF_INDEX = "model.safetensors.index.json"
HF_DIR = "hf"
LAYOUT_BOTH = "both"
LAYOUTS = (LAYOUT_VLLM_FUSED, LAYOUT_HF, LAYOUT_BOTH)
READERS = ("auto", "dcp-load")
TMP_VERSION_PREFIX = ".tmp-v"
HF_SHARD_BYTES = 5 * 10**9
"""transformers' default ``max_shard_size`` ("5GB")."""
_METADATA = {"format": "pt"}


def version_dir_name(version: int) -> str:
    return f"v{version}"


rank_file_name = fused_rank_file


@dataclass(frozen=True)
class ConvertOptions:
    tp: int = 1
    layout: str = LAYOUT_VLLM_FUSED
    per_rank_files: bool = False
    reader: str = "auto"
    """``auto``: byte ranges when the storage allows, else ``dcp.load``; ``dcp-load``: always."""


@dataclass(frozen=True)
class Published:
    path: Path
    manifest: Manifest
    manifest_sha256: str
    reader: str


def convert(
    snapshot: Snapshot,
    weights_dir: Path,
    version: int,
    tp: int | None = None,
    options: ConvertOptions | None = None,
) -> Published:
    """Write ``snapshot`` as version ``version``.

    Raises :class:`CorruptSnapshot` for a snapshot that cannot be published, LayoutError for a
    tp (or per-rank split) vLLM would refuse for this model: the setting is wrong, not the
    snapshot. OSError (a full disk...) leaves no temp directory behind and propagates.
    """
    options = options or ConvertOptions(tp=tp or 1)
    if options.layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {options.layout!r}; choose one of {', '.join(LAYOUTS)}")
    config = read_config(snapshot)
    source = open_source(snapshot, options.reader)
    try:
        shape = ModelShape.from_hf_config(config)
        shapes = source.shapes()
        check_shapes({n: s for n, (s, _) in shapes.items()}, shape)
    except LayoutError as exc:
        raise CorruptSnapshot(str(exc)) from None
    check_tp(shape, options.tp)
    try:  # the tp is servable, so what planning refuses is in the snapshot's tensors
        plan = plan_vllm_fused({n: s[0] for n, (s, _) in shapes.items()}, shape, options.tp)
    except LayoutError as exc:
        raise CorruptSnapshot(str(exc)) from None
    if options.per_rank_files:
        for p in plan:
            rank_slice(p.shard, _fused_meta(p, shapes)[1], 0, options.tp)
    tmp = weights_dir / f"{TMP_VERSION_PREFIX}{version}"
    final = weights_dir / version_dir_name(version)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files, tensors = _write_layouts(tmp, source, shapes, plan, shape, options, config)
        dtypes = {t.dtype for t in tensors}
        manifest = Manifest(
            version=version,
            step=snapshot.step,
            run_id=snapshot.info.run_id,
            snapshot_id=snapshot.info.snapshot_id,
            layout=LAYOUT_HF if options.layout == LAYOUT_HF else LAYOUT_VLLM_FUSED,
            tp=options.tp,
            dtype=dtypes.pop() if len(dtypes) == 1 else "mixed",
            files=files,
            tensors=tensors,
            per_rank_files=options.per_rank_files and options.tp > 1,
            hf_dir=HF_DIR if options.layout == LAYOUT_BOTH else None,
        )
        manifest_json = manifest.to_json().encode()
        write_bytes(tmp / MANIFEST_NAME, manifest_json)
        if options.layout == LAYOUT_BOTH:
            fsync_path(tmp / HF_DIR)
        fsync_path(tmp)
        publish_dir(tmp, final)
    except SourceEnded as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CorruptSnapshot(f"a data file is shorter than .metadata says: {exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Published(final, manifest, sha256_bytes(manifest_json), source.kind)


def open_source(snapshot: Snapshot, reader: str = "auto") -> Source:
    """Byte ranges into the snapshot's files, or its tensors loaded with ``dcp.load``."""
    metadata = read_metadata(snapshot.path)
    check_sizes(snapshot.path, metadata)
    if reader == "auto":
        try:
            return DcpSource(index_snapshot(snapshot.path, metadata))
        except Unsupported:
            pass
    elif reader != "dcp-load":
        raise LayoutError(f"unknown reader {reader!r}; choose {' or '.join(READERS)}")
    return MemorySource(load_tensors(snapshot, metadata))


def fused_outputs(
    plan: Sequence[FusedTensor], source: Source, shapes: Mapping[str, Any]
) -> list[OutputTensor]:
    """The whole fused tensors, each a concatenation of source row blocks."""
    return [
        OutputTensor(p.name, *_fused_meta(p, shapes), tuple(_fused_rows(p, source, 0, p.rows)))
        for p in plan
    ]


def rank_outputs(
    plan: Sequence[FusedTensor], source: Source, shapes: Mapping[str, Any], tp: int, rank: int
) -> list[OutputTensor]:
    """What vLLM's rank ``rank`` holds of each fused tensor (``layout.rank_slice``)."""
    outputs = []
    for p in plan:
        dtype, full = _fused_meta(p, shapes)
        part = rank_slice(p.shard, full, rank, tp)
        if part is None:
            pieces, shape = _fused_rows(p, source, 0, p.rows), full
        elif part.dim == 0:
            pieces = _fused_rows(p, source, part.start, part.stop)
            shape = (part.stop - part.start, *full[1:])
        else:
            if len(p.pieces) != 1 or len(full) != 2 or part.dim != 1:
                raise LayoutError(f"{p.name}: cannot split along dim {part.dim}")
            pieces = source.columns(p.pieces[0].source, part.start, part.stop)
            shape = (full[0], part.stop - part.start)
        outputs.append(OutputTensor(p.name, dtype, shape, tuple(pieces)))
    return outputs


def hf_outputs(source: Source, shapes: Mapping[str, Any], shape: ModelShape) -> list[OutputTensor]:
    """The HF tensors as they are (a tied ``lm_head`` left out, as HF checkpoints do)."""
    return [
        OutputTensor(name, dtype, tuple(size), tuple(source.rows(name, 0, size[0])))
        for name, (size, dtype) in shapes.items()
        if not (name == "lm_head.weight" and shape.tie_word_embeddings)
    ]


def _fused_meta(p: FusedTensor, shapes: Mapping[str, Any]) -> tuple[torch.dtype, tuple]:
    dtypes = {shapes[piece.source][1] for piece in p.pieces}
    if len(dtypes) != 1:
        raise LayoutError(f"{p.name}: its parts have different dtypes {sorted(map(str, dtypes))}")
    first = shapes[p.pieces[0].source][0]
    return dtypes.pop(), (p.rows, *first[1:])


def _fused_rows(p: FusedTensor, source: Source, start: int, stop: int) -> list[Piece]:
    """Pieces for rows ``[start, stop)`` of fused tensor ``p``."""
    pieces: list[Piece] = []
    at = 0
    for part in p.pieces:
        lo, hi = max(start, at), min(stop, at + part.rows)
        if lo < hi:
            first = part.start + lo - at
            pieces += source.rows(part.source, first, first + hi - lo)
        at += part.rows
    return pieces


def _write_layouts(
    tmp: Path,
    source: Source,
    shapes: Mapping[str, Any],
    plan: Sequence[FusedTensor],
    shape: ModelShape,
    options: ConvertOptions,
    config: Mapping[str, Any],
) -> tuple[list[FileEntry], list[TensorEntry]]:
    files: list[FileEntry] = []
    tensors: list[TensorEntry] = []
    shards = {p.name: dict(p.shard) for p in plan}
    if options.layout in (LAYOUT_VLLM_FUSED, LAYOUT_BOTH):
        if options.per_rank_files and options.tp > 1:
            for rank in range(options.tp):
                name = rank_file_name(rank, options.tp)
                outputs = rank_outputs(plan, source, shapes, options.tp, rank)
                files.append(_write_file(tmp, name, outputs))
                tensors += [_entry(t, name, shards[t.name], rank) for t in outputs]
        else:
            outputs = fused_outputs(plan, source, shapes)
            files.append(_write_file(tmp, WEIGHTS_FILE, outputs))
            tensors += [_entry(t, WEIGHTS_FILE, shards[t.name]) for t in outputs]
    if options.layout in (LAYOUT_HF, LAYOUT_BOTH):
        hf_dir = tmp / HF_DIR if options.layout == LAYOUT_BOTH else tmp
        prefix = f"{HF_DIR}/" if options.layout == LAYOUT_BOTH else ""
        hf_dir.mkdir(exist_ok=True)
        outputs = hf_outputs(source, shapes, shape)
        hf_files, weight_map = _write_hf(hf_dir, outputs)
        if options.layout == LAYOUT_BOTH:
            hf_files.append(_write_json_file(hf_dir, CONFIG_NAME, config))
        files += [dataclasses.replace(f, name=prefix + f.name) for f in hf_files]
        if options.layout == LAYOUT_HF:
            by_name = {t.name: t for t in outputs}
            tensors += [_entry(by_name[n], f, {"kind": "hf"}) for n, f in weight_map.items()]
    top_config = config if options.layout == LAYOUT_HF else fused_config(config)
    files.append(_write_json_file(tmp, CONFIG_NAME, top_config))
    return files, tensors


def _write_hf(
    directory: Path, outputs: Sequence[OutputTensor]
) -> tuple[list[FileEntry], dict[str, str]]:
    """Shards of at most ``HF_SHARD_BYTES`` and the index; the files and the index's
    ``weight_map`` (tensor name -> shard file, sorted by name)."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for t in outputs:
        if shards[-1] and size + t.nbytes > HF_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    files = []
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        files.append(_write_file(directory, name, shard))
        weight_map |= {t.name: name for t in shard}
    weight_map = dict(sorted(weight_map.items()))
    index = {"metadata": {"total_size": sum(t.nbytes for t in outputs)}, "weight_map": weight_map}
    files.append(_write_json_file(directory, HF_INDEX, index))
    return files, weight_map


def _write_file(directory: Path, name: str, outputs: Sequence[OutputTensor]) -> FileEntry:
    return write_safetensors(directory / name, outputs, _METADATA)


def _write_json_file(directory: Path, name: str, data: object) -> FileEntry:
    write_json(directory / name, data)
    return file_entry(directory / name)


def _entry(
    t: OutputTensor, file: str, shard: dict[str, Any], rank: int | None = None
) -> TensorEntry:
    return TensorEntry(
        t.name, file, list(t.shape), str(t.dtype).removeprefix("torch."), shard, rank
    )
