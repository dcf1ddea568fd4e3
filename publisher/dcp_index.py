"""Where each tensor's raw bytes lie inside a DCP snapshot, without loading any tensor.

DCP's ``FileSystemWriter`` stores every tensor chunk as its own ``torch.save`` record (a zip
archive with stored, uncompressed entries) at an offset that ``.metadata`` gives. Inside the
record, the entry ``<archive>/data/0`` holds the chunk's storage; its local zip header says
where those bytes start. This module finds them and checks that they are exactly the chunk,
row-major, little-endian, so the publisher can copy byte ranges from file to file.

The record's tiny ``data.pkl`` (which says dtype, shape, strides) is read with an unpickler
that resolves no global at all: every name it mentions becomes an inert marker, so nothing
from the snapshot is executed. Anything unusual raises :class:`Unsupported` and the caller
falls back to ``dcp.load``; damage raises :class:`CorruptSnapshot`.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from weightcast.publisher.snapshot_reader import CorruptSnapshot, read_metadata

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"
_STORAGE_DTYPES = {
    "BFloat16Storage": torch.bfloat16,
    "HalfStorage": torch.float16,
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


class Unsupported(Exception):
    """The snapshot is fine but not laid out for byte ranges; use ``dcp.load`` instead."""


@dataclass(frozen=True)
class Chunk:
    """Rows ``[row_start, row_stop)`` of a tensor, stored row-major at ``offset`` in ``file``."""

    file: Path
    offset: int
    row_start: int
    row_stop: int


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the snapshot: its dtype, full shape and dim-0 chunks in row order."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def check_sizes(path: Path, metadata: Metadata) -> None:
    """Raise :class:`CorruptSnapshot` when a data file is shorter than ``.metadata`` says."""
    sizes: dict[str, int] = {}
    for key, info in _storage(metadata).items():
        if info.relative_path not in sizes:
            sizes[info.relative_path] = _file_size(path / info.relative_path)
        size = sizes[info.relative_path]
        if info.offset + info.length > size:
            raise CorruptSnapshot(
                f"{info.relative_path} is truncated: {key.fqn} needs bytes up to "
                f"{info.offset + info.length}, the file has {size}"
            )


def index_snapshot(path: Path, metadata: Metadata | None = None) -> dict[str, SourceTensor]:
    """Name -> :class:`SourceTensor` for every tensor of the snapshot at ``path``."""
    metadata = read_metadata(path) if metadata is None else metadata
    check_sizes(path, metadata)
    storage = {(key.fqn, tuple(key.offset)): info for key, info in _storage(metadata).items()}
    index: dict[str, SourceTensor] = {}
    for name, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        dtype, shape = entry.properties.dtype, tuple(entry.size)
        chunks = []
        for i, chunk in enumerate(entry.chunks):
            offsets, chunk_shape = tuple(chunk.offsets), tuple(chunk.sizes)
            if any(offsets[1:]) or chunk_shape[1:] != shape[1:] or not shape:
                raise Unsupported(f"{name}: chunk {offsets} {chunk_shape} is not a block of rows")
            if math.prod(chunk_shape) == 0:
                continue
            info = _storage_info(storage, name, offsets, i)
            file = path / info.relative_path
            if getattr(info, "transform_descriptors", None):
                raise Unsupported(f"{name}: stored with transforms {info.transform_descriptors}")
            data_offset = _locate_data(file, info.offset, info.length, dtype, chunk_shape, name)
            chunks.append(Chunk(file, data_offset, offsets[0], offsets[0] + chunk_shape[0]))
        chunks.sort(key=lambda c: c.row_start)
        expected = 0
        for chunk in chunks:
            if chunk.row_start != expected:
                raise Unsupported(f"{name}: chunks overlap or leave a gap at row {expected}")
            expected = chunk.row_stop
        if shape and expected != shape[0]:
            raise Unsupported(f"{name}: chunks cover {expected} of {shape[0]} rows")
        index[name] = SourceTensor(name, dtype, shape, tuple(chunks))
    return index


def _storage(metadata: Metadata) -> Mapping[Any, Any]:
    return metadata.storage_data or {}


def _storage_info(storage: Mapping[Any, Any], name: str, offsets: tuple[int, ...], i: int) -> Any:
    try:
        return storage[(name, offsets)]
    except KeyError:
        raise CorruptSnapshot(
            f".metadata has no storage entry for {name} chunk {i} at {offsets}"
        ) from None


def _file_size(file: Path) -> int:
    try:
        return os.path.getsize(file)
    except OSError as exc:
        raise CorruptSnapshot(f"data file unreadable: {exc}") from None


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``offset`` of an open file."""

    def __init__(self, f: io.BufferedReader, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        data = os.pread(self.f.fileno(), n, self.offset + self.pos)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


class _Marker:
    """Stands for any global the record's pickle names; calling it records the arguments."""

    def __init__(self, module: str, name: str) -> None:
        self.qualname = f"{module}.{name}"
        self.args: tuple[Any, ...] = ()

    def __call__(self, *args: Any) -> _Marker:
        made = _Marker(*self.qualname.rsplit(".", 1))
        made.args = args
        return made


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> _Marker:
        return _Marker(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return pid


def _locate_data(
    file: Path, offset: int, length: int, dtype: torch.dtype, shape: tuple[int, ...], name: str
) -> int:
    """Absolute offset in ``file`` of the chunk's raw row-major bytes inside its record."""
    nbytes = math.prod(shape) * dtype.itemsize
    with open(file, "rb") as f:
        try:
            archive = zipfile.ZipFile(io.BufferedReader(_Window(f, offset, length)))
        except (zipfile.BadZipFile, OSError) as exc:
            raise CorruptSnapshot(f"{name}: record in {file.name} is not readable: {exc}") from None
        with archive:
            entries = {i.filename.split("/", 1)[-1]: i for i in archive.infolist()}
            data = entries.get("data/0")
            if data is None or "data.pkl" not in entries or len(entries) > 16:
                raise Unsupported(f"{name}: unexpected record entries {sorted(entries)}")
            if data.compress_type != zipfile.ZIP_STORED or data.file_size != nbytes:
                raise Unsupported(f"{name}: storage is compressed or not exactly the chunk")
            if "byteorder" in entries and archive.read(entries["byteorder"]) != b"little":
                raise Unsupported(f"{name}: big-endian storage")
            _check_rebuild(archive.read(entries["data.pkl"]), dtype, shape, name)
        header = os.pread(f.fileno(), _LOCAL_HEADER.size, offset + data.header_offset)
    if len(header) < _LOCAL_HEADER.size or header[:4] != _LOCAL_MAGIC:
        raise CorruptSnapshot(f"{name}: damaged zip header in {file.name}")
    fields = _LOCAL_HEADER.unpack(header)
    start = data.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if start + nbytes > length:
        raise CorruptSnapshot(f"{name}: record in {file.name} is shorter than its data")
    return offset + start


def _check_rebuild(pkl: bytes, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> None:
    """The record must rebuild one contiguous tensor over all of storage ``0``."""
    try:
        rebuilt = _InertUnpickler(io.BytesIO(pkl)).load()
    except Exception as exc:  # any odd pickle is simply not ours to copy byte-wise
        raise Unsupported(f"{name}: record pickle not understood: {exc}") from None
    if not isinstance(rebuilt, _Marker) or rebuilt.qualname != "torch._utils._rebuild_tensor_v2":
        raise Unsupported(f"{name}: record is not a plain tensor")
    storage, storage_offset, size, stride = rebuilt.args[:4]
    if not (isinstance(storage, tuple) and len(storage) == 5 and storage[0] == "storage"):
        raise Unsupported(f"{name}: unexpected storage reference")
    storage_type = storage[1].qualname.rsplit(".", 1)[-1] if isinstance(storage[1], _Marker) else ""
    contiguous = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    if (
        _STORAGE_DTYPES.get(storage_type) != dtype
        or storage[2] != "0"
        or storage_offset != 0
        or tuple(size) != shape
        or (math.prod(shape) > 1 and _strides_differ(tuple(stride), contiguous, shape))
    ):
        raise Unsupported(
            f"{name}: stored as {storage_type} offset {storage_offset} size {size} "
            f"stride {stride}; expected contiguous {dtype} {shape}"
        )


def _strides_differ(stride: tuple[int, ...], expected: tuple[int, ...], shape: tuple) -> bool:
    """Strides of size-1 dimensions do not matter for the memory order."""
    return any(s != e for s, e, n in zip(stride, expected, shape, strict=True) if n != 1)
