"""``manifest.json``: what a published version holds and how to check it.

It lists every file with its size and digests and every tensor with its shape, dtype, file
and how vLLM shards it. Readers verify what they read against it before using any of it.

Digests. Formats 2 and 3 (:data:`MANIFEST_FORMAT`) split each file into blocks of
``block_bytes`` (:data:`BLOCK_BYTES`, 4 MiB; the last block may be shorter) and lists one
digest per block (:class:`BlockDigests`), so that a writer hashes blocks in parallel with
its writes and a reader verifies exactly the blocks it reads (a tensor-parallel rank reads a
few byte ranges of a shared file). Format 1 manifests (one whole-file ``sha256`` per file)
still read and verify. The manifest itself is authenticated by the SHA-256 that the registry
keeps in Redis (``manifest_sha256``), so a block digest only has to tie the bytes on disk to
the manifest: ``xxh3-128`` (the default, several GB/s a core) catches corruption (bit rot,
truncation, a torn or misplaced write); ``blake3`` (a cryptographic hash) also resists
deliberate tampering by someone who can write the weights directory but not Redis.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Protocol

from weightcast.contract.delta import Delta, delta_from_json
from weightcast.contract.errors import LayoutError, WeightsError
from weightcast.contract.layout import LAYOUT_HF, LAYOUT_VLLM_FUSED
from weightcast.contract.sharding import Shard, ShardKind
from weightcast.contract.tensorfile import TORCH_NAMES, nbytes, safetensors_dtype
from weightcast.contract.untrusted import Fields, json_object, shown

MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
"""The largest ``manifest.json`` a reader takes."""
MANIFEST_FORMAT = "weightcast.manifest/3"
MANIFEST_FORMATS = ("weightcast.manifest/1", "weightcast.manifest/2", MANIFEST_FORMAT)
"""The formats this weightcast reads. Format 3 stores row-parallel tensors per rank
(``row_parallel_ranks``); a node older than it refuses a format 3 version."""
BLOCK_BYTES = 4 * 1024 * 1024
MIXED_DTYPE = "mixed"
"""A version's ``dtype`` when its tensors have several (FP8 weights, float32 scales, bf16)."""
DEFAULT_DIGEST = "xxh3-128"
DIGESTS = ("xxh3-128", "blake3")
"""Block digest algorithms a manifest may name (``sha256`` is format 1's whole-file one)."""
_CHUNK = 8 * 1024 * 1024
MAX_DIMS = 64
"""The most dimensions a tensor entry may list: a model's tensors have one or two, and the
bound keeps the size arithmetic of a hostile shape small."""


class ManifestError(WeightsError):
    """A version directory that does not match its manifest."""


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher for ``algorithm`` (``xxh3-128``, ``blake3`` or ``sha256``)."""
    factory = _hashers().get(algorithm)
    if factory is None:
        raise ManifestError(
            f"unknown digest algorithm {algorithm!r}; this weightcast knows "
            f"{', '.join(sorted(_hashers()))} (pip install blake3 for blake3)"
        )
    return factory()


def digest_bytes(algorithm: str, data: bytes | memoryview) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def _hashers() -> dict[str, Callable[[], Hasher]]:
    """The algorithms importable here (blake3 is optional; a vLLM image has it)."""
    import xxhash

    found: dict[str, Callable[[], Hasher]] = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}
    try:
        import blake3
    except ImportError:
        return found
    found["blake3"] = blake3.blake3
    return found


@dataclass(frozen=True)
class BlockDigests:
    """One digest per block of a file, in file order.

    Blocks are ``block_bytes`` long (the last may be shorter) unless ``lengths`` lists each
    block's length: a writer that knows the layout cuts blocks at tensor and rank-slice
    boundaries (none longer than ``block_bytes``), so that a tensor-parallel rank reads and
    verifies its own byte ranges and next to nothing else.
    """

    algorithm: str
    block_bytes: int
    digests: list[str]
    lengths: list[int] | None = None

    @cached_property
    def starts(self) -> list[int]:
        """The file offset where each block begins, and the file's end last."""
        if self.lengths is None:
            return [i * self.block_bytes for i in range(len(self.digests) + 1)]
        return [0, *itertools.accumulate(self.lengths)]

    def block_range(self, start: int, stop: int) -> range:
        """The indices of the blocks that hold bytes ``[start, stop)`` of the file."""
        if stop <= start:
            return range(0)
        first = bisect.bisect_right(self.starts, start) - 1
        last = bisect.bisect_left(self.starts, stop) - 1
        return range(max(first, 0), min(last + 1, len(self.digests)))

    def span(self, index: int, file_bytes: int) -> tuple[int, int]:
        """Bytes ``[start, stop)`` of the file that block ``index`` covers."""
        return self.starts[index], min(self.starts[index + 1], file_bytes)

    def covers(self, file_bytes: int) -> bool:
        """Whether the blocks tile exactly ``file_bytes`` bytes, none over ``block_bytes``."""
        if self.block_bytes < 1:
            return False
        if self.lengths is None:
            return len(self.digests) == -(-file_bytes // self.block_bytes)
        return (
            len(self.lengths) == len(self.digests)
            and sum(self.lengths) == file_bytes
            and all(0 < n <= self.block_bytes for n in self.lengths)
        )


@dataclass(frozen=True)
class FileEntry:
    """A file of the version: its size and either per-block digests (format 2) or one
    whole-file SHA-256 (format 1)."""

    name: str
    bytes: int
    sha256: str | None = None
    blocks: BlockDigests | None = None

    def __post_init__(self) -> None:
        if (self.sha256 is None) == (self.blocks is None):
            raise ManifestError(f"{self.name}: a file needs block digests or a sha256")
        if self.blocks is not None and not self.blocks.covers(self.bytes):
            raise ManifestError(
                f"{self.name}: its {len(self.blocks.digests)} blocks do not tile its "
                f"{self.bytes} bytes (blocks of at most {self.blocks.block_bytes})"
            )

    def verify_block(self, index: int, data: bytes | memoryview) -> None:
        """Raise :class:`ManifestError` unless ``data`` is block ``index`` of this file."""
        assert self.blocks is not None
        if digest_bytes(self.blocks.algorithm, data) != self.blocks.digests[index]:
            start, stop = self.blocks.span(index, self.bytes)
            raise ManifestError(
                f"{self.name}: bytes {start}..{stop} do not match the manifest's "
                f"{self.blocks.algorithm} digest (the file is corrupt or was changed)"
            )


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in one file. ``shard`` says how vLLM splits it (see ``sharding.rank_slice``).

    ``rank`` is None for a whole tensor. In a version with per-rank files each tensor has one
    entry per rank: ``file`` is that rank's file, ``shape`` the rank's part, ``rank`` its rank.
    """

    name: str
    file: str
    shape: list[int]
    dtype: str
    shard: Shard
    rank: int | None = None

    @property
    def nbytes(self) -> int:
        return nbytes(safetensors_dtype(self.dtype), self.shape)


@dataclass
class Manifest:
    version: int
    step: int
    run_id: str
    snapshot_id: str
    layout: str
    tp: int
    dtype: str
    files: list[FileEntry] = field(default_factory=list)
    tensors: list[TensorEntry] = field(default_factory=list)
    per_rank_files: bool = False
    """True when each tp rank's parameters are in a file of their own (``rank`` entries)."""
    hf_dir: str | None = None
    """Set when the version also holds the plain HF layout in this subdirectory (``hf``)."""
    format: str = MANIFEST_FORMAT
    ep: int | None = None
    """A fused mixture of experts only (absent otherwise): the expert parallelism its
    ``experts`` tensors are laid out for, 1 (each expert split over the ``tp`` ranks) or
    ``tp`` (vLLM's ``enable_expert_parallel``: whole experts per rank). With ``tp`` it names
    the one placement the version serves."""
    delta: Delta | None = None
    """The delta from an earlier version written beside this one (format 3), if any."""

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> str:
        raw = asdict(self)
        for entry, tensor in zip(raw["tensors"], self.tensors, strict=True):
            entry["shard"] = tensor.shard.as_json()
        if self.ep is None:
            del raw["ep"]  # dense versions stay readable by readers that know no experts
        return json.dumps(raw, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse ``manifest.json``, checking every field's type and bounds, each tensor's
        shard spec against its shape, and its bytes against its file's size: any fault is a
        :class:`ManifestError` naming the field."""
        raw = json_object(text, MANIFEST_NAME, ManifestError)
        if raw.get("format") not in MANIFEST_FORMATS:
            raise ManifestError(
                f"manifest format {shown(raw.get('format'))} is not one this weightcast reads "
                f"({', '.join(MANIFEST_FORMATS)}): upgrade weightcast on this node"
            )
        top = Fields(raw, "", ManifestError, _names(cls))
        files = [_file_entry(f, i) for i, f in enumerate(top.items("files"))]
        by_name = {f.name: f for f in files}
        if len(by_name) != len(files):
            raise ManifestError("files lists a file twice")
        context = _Context(
            layout=top.text("layout", (LAYOUT_VLLM_FUSED, LAYOUT_HF)),
            tp=top.integer("tp", minimum=1),
            per_rank_files=top.flag("per_rank_files", False),
            ep=top.optional_integer("ep", minimum=1),
        )
        if context.ep is not None and context.ep not in (1, context.tp):
            raise ManifestError(
                f"ep is {context.ep}: a tp={context.tp} version's experts are laid out for "
                f"ep 1 or {context.tp}"
            )
        delta = top.value("delta", None)
        manifest = cls(
            version=top.integer("version"),
            step=top.integer("step"),
            run_id=top.text("run_id"),
            snapshot_id=top.text("snapshot_id"),
            layout=context.layout,
            tp=context.tp,
            dtype=top.text("dtype", (*TORCH_NAMES.values(), MIXED_DTYPE)),
            files=files,
            tensors=[
                _tensor_entry(t, i, context, by_name) for i, t in enumerate(top.items("tensors"))
            ],
            per_rank_files=context.per_rank_files,
            hf_dir=top.optional_text("hf_dir"),
            format=top.text("format"),
            ep=context.ep,
            delta=None if delta is None else delta_from_json(delta, ManifestError),
        )
        if manifest.delta is not None:
            _check_delta(manifest.delta, manifest.version, by_name)
        return manifest

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        return cls.from_json((directory / MANIFEST_NAME).read_bytes())


@dataclass(frozen=True)
class _Context:
    """The manifest's fields that its tensor entries are checked against."""

    layout: str
    tp: int
    per_rank_files: bool
    ep: int | None


def _check_delta(delta: Delta, version: int, files: dict[str, FileEntry]) -> None:
    """The delta's file is listed with its size, and it has a frame length for every block
    of each weights file it covers."""
    if delta.base_version >= version:
        raise ManifestError(f"delta.base_version {delta.base_version} is not before {version}")
    listed = files.get(delta.file)
    if listed is None or listed.bytes != delta.bytes:
        raise ManifestError(
            f"delta.file {delta.file!r} is not listed with the {delta.bytes} bytes of its frames"
        )
    for index, entry in enumerate(delta.files):
        target = files.get(entry.name)
        blocks = None if target is None else target.blocks
        if blocks is None or len(entry.lengths) != len(blocks.digests):
            raise ManifestError(
                f"delta.files[{index}] ({entry.name}) is not a listed file with block digests "
                f"and one frame length per block"
            )


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _file_entry(raw: object, index: int) -> FileEntry:
    entry = Fields(raw, f"files[{index}]", ManifestError, _names(FileEntry))
    name = entry.text("name")
    _check_file_name(name)
    blocks = entry.value("blocks", None)
    return FileEntry(
        name,
        entry.integer("bytes"),
        entry.optional_text("sha256"),
        None if blocks is None else _block_digests(blocks, entry.path("blocks")),
    )


def _block_digests(raw: object, where: str) -> BlockDigests:
    blocks = Fields(raw, where, ManifestError, _names(BlockDigests))
    return BlockDigests(
        blocks.text("algorithm", DIGESTS),
        blocks.integer("block_bytes", minimum=1),
        blocks.texts("digests"),
        blocks.optional_integers("lengths", minimum=1),
    )


def _tensor_entry(
    raw: object, index: int, context: _Context, files: dict[str, FileEntry]
) -> TensorEntry:
    tensor = Fields(raw, f"tensors[{index}]", ManifestError, _names(TensorEntry))
    name = tensor.text("name")
    where = f"{tensor.where} ({name})"
    try:
        shard = Shard.from_json(tensor.value("shard"))
    except LayoutError as exc:
        raise ManifestError(f"{where}.shard {exc}") from None
    entry = TensorEntry(
        name,
        tensor.text("file"),
        tensor.integers("shape"),
        tensor.text("dtype", TORCH_NAMES.values()),
        shard,
        tensor.optional_integer("rank"),
    )
    if len(entry.shape) > MAX_DIMS:
        raise ManifestError(
            f"{where}.shape has {len(entry.shape)} dimensions, more than {MAX_DIMS}"
        )
    if (shard.kind == ShardKind.HF) != (context.layout == LAYOUT_HF):
        raise ManifestError(f"{where}.shard is {shard.kind}, in a {context.layout} version")
    if shard.kind == ShardKind.EXPERTS and shard.ep != context.ep:
        placement = "that names no ep" if context.ep is None else f"for ep={context.ep}"
        raise ManifestError(
            f"{where}.shard is laid out for ep={shard.ep}, in a version {placement}"
        )
    if context.per_rank_files != (entry.rank is not None) or (entry.rank or 0) >= context.tp:
        raise ManifestError(
            f"{where}.rank is {entry.rank!r}: a version "
            f"{'with' if context.per_rank_files else 'without'} per-rank files for tp={context.tp}"
        )
    try:
        shard.check(entry.shape, context.tp, whole=not context.per_rank_files)
    except LayoutError as exc:
        raise ManifestError(f"{where}.shard does not fit its shape {entry.shape}: {exc}") from None
    file = files.get(entry.file)
    if file is not None and entry.nbytes > file.bytes:
        raise ManifestError(
            f"{where}: {entry.nbytes} bytes of {entry.dtype} {entry.shape}, more than its file "
            f"{entry.file} holds ({file.bytes})"
        )
    return entry


def file_digests(
    path: Path, algorithm: str = DEFAULT_DIGEST, block_bytes: int = BLOCK_BYTES
) -> BlockDigests:
    """The block digests of a file on disk (small files: JSON, configs)."""
    digests = []
    with open(path, "rb") as f:
        while block := f.read(block_bytes):
            digests.append(digest_bytes(algorithm, block))
    return BlockDigests(algorithm, block_bytes, digests)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_entry(path: Path, algorithm: str = DEFAULT_DIGEST) -> FileEntry:
    """The manifest entry of a file on disk, with block digests."""
    return FileEntry(path.name, os.path.getsize(path), blocks=file_digests(path, algorithm))


def verify_files(directory: Path, manifest: Manifest) -> None:
    """Check every listed file whole: size, and every block digest (or the sha256)."""
    for entry in manifest.files:
        path = directory / entry.name
        if not path.is_file():
            raise ManifestError(f"{path}: missing")
        size = os.path.getsize(path)
        if size != entry.bytes:
            raise ManifestError(f"{path}: {size} bytes, manifest says {entry.bytes}")
        if entry.blocks is None:
            if sha256_file(path) != entry.sha256:
                raise ManifestError(f"{path}: sha256 does not match the manifest")
            continue
        with open(path, "rb") as f:
            for index in range(len(entry.blocks.digests)):
                start, stop = entry.blocks.span(index, entry.bytes)
                entry.verify_block(index, f.read(stop - start))


def _check_file_name(name: str) -> None:
    """A file name, or ``<subdir>/<name>`` for the ``hf`` subdirectory; nothing that escapes."""
    parts = name.split("/")
    if len(parts) > 2 or "\\" in name or any(not part or part in (".", "..") for part in parts):
        raise ManifestError(f"manifest names an unsafe file {name!r}")
