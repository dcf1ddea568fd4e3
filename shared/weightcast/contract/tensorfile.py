"""The safetensors file format: how the trainer and the publisher write it, and the one
defensive parser every reader uses (the publisher reading snapshots, nodes reading versions).

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON, then
the data: ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str:
str}}`` with offsets relative to byte ``8 + N``. Headers come from files written by other
processes, so nothing in one is trusted: :func:`header_length` checks the length against
the file before anything is sized by it, and :func:`parse_header` checks every entry against
itself and the file (known dtype, bytes equal to shape times element size, inside the file,
the tensors tiling the data with no hole or overlap). A reader can then copy byte ranges out
of the file without ever loading it (and without pickle). :func:`read_header` does both for
an open file; a node, which verifies the header's blocks before parsing them, calls the two
on the bytes it verified. Errors are :class:`HeaderError`, naming the file.

:func:`encode_header` builds the header the way ``safetensors.torch.save_file`` does (tensors
ordered by :func:`file_order`, compact JSON padded with spaces to 8 bytes), so a file made of
that header and the tensors' bytes is byte for byte what ``save_file`` writes. Both orderings
keep every tensor aligned to its element size in the file.

Dtypes are safetensors' names (``BF16``...): this module needs no torch.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightcast.contract.errors import WeightcastError
from weightcast.contract.untrusted import json_object

DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
"""Element size of every dtype weightcast reads or writes, in safetensors' ``Dtype`` order
(``save_file`` writes the last, widest, first)."""
_DTYPE_ORDER = {name: i for i, name in enumerate(DTYPE_SIZES)}
TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}
"""safetensors dtype -> torch's name for it (what manifests and the registry record)."""
_BY_TORCH_NAME = {torch_name: name for name, torch_name in TORCH_NAMES.items()}


def safetensors_dtype(dtype: object) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``BF16``)."""
    try:
        return _BY_TORCH_NAME[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"safetensors cannot hold {dtype}") from None


NON_FINITE = {
    "BF16": (0x7FFF, 0x7F80),
    "F16": (0x7FFF, 0x7C00),
    "F32": (0x7FFF_FFFF, 0x7F80_0000),
    "F64": (0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    "F8_E5M2": (0x7F, 0x7C),
    "F8_E4M3": (0x7F, 0x7F),
}
"""Float dtype -> ``(mask, limit)``: an element is NaN or infinite exactly when its bits,
read as an unsigned integer of the element's size, satisfy ``bits & mask >= limit`` (the
exponent is all ones; float8 e4m3fn has no infinity and one NaN pattern per sign)."""

PREFIX_BYTES = 8
"""The little-endian length of the JSON header that starts every file."""
MAX_HEADER_BYTES = 100_000_000
"""The largest header accepted (the safetensors library's own limit)."""
METADATA_KEY = "__metadata__"


class HeaderError(WeightcastError, ValueError):
    """A header that is not valid safetensors or contradicts the file it heads."""


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a file: dtype, shape and its bytes ``[start, stop)`` of the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Header:
    """A parsed header: the metadata strings and the tensors in file order."""

    metadata: Mapping[str, str]
    tensors: tuple[TensorSpan, ...]
    data_start: int
    file_bytes: int


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * DTYPE_SIZES[dtype]


def file_order(items: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """``(name, dtype)`` pairs in ``save_file``'s order: widest dtype first, then by name."""
    return sorted(items, key=lambda item: (-_DTYPE_ORDER[item[1]], item[0]))


def encode_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]], metadata: Mapping[str, str] | None
) -> bytes:
    """Length prefix and JSON header for ``(name, dtype, shape)`` in the order given."""
    entries: dict[str, Any] = {METADATA_KEY: dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in tensors:
        size = nbytes(dtype, shape)
        entries[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def read_header(fd: int, label: str) -> Header:
    """Parse and check the header of the open file ``fd`` (``label`` names it in errors)."""
    size = os.fstat(fd).st_size
    length = header_length(os.pread(fd, PREFIX_BYTES, 0), size, label)
    text = os.pread(fd, length, PREFIX_BYTES)
    if len(text) != length:
        raise HeaderError(f"{label}: the file ended inside its safetensors header")
    return parse_header(text, size, label)


def header_length(prefix: bytes, file_bytes: int, label: str) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file's
    size before anything is sized by it (a header claiming 2**62 bytes is an error, never
    an allocation)."""
    if file_bytes < PREFIX_BYTES or len(prefix) != PREFIX_BYTES:
        raise HeaderError(f"{label}: {file_bytes} bytes, too short for a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, file_bytes - PREFIX_BYTES):
        raise HeaderError(
            f"{label}: safetensors header claims {length} bytes; the file has "
            f"{file_bytes - PREFIX_BYTES} after the length (at most {MAX_HEADER_BYTES})"
        )
    return length


def parse_header(text: bytes, file_bytes: int, label: str) -> Header:
    """The header ``text`` (the bytes after the length) of a ``file_bytes``-byte file.

    Nothing in it is trusted: every tensor needs a known dtype, a shape and two data offsets
    of non-negative integers, exactly ``shape x element size`` bytes, all inside the file;
    together the tensors tile the data section with no hole or overlap up to the file's end.
    """
    raw = json_object(text, f"{label}: safetensors header", HeaderError)
    metadata = raw.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise HeaderError(f"{label}: safetensors header's __metadata__ must map strings to strings")
    data_start = PREFIX_BYTES + len(text)
    spans = sorted(
        (_span(name, entry, data_start, file_bytes, label) for name, entry in raw.items()),
        key=lambda s: (s.start, s.stop),
    )
    at = data_start
    for span in spans:
        if span.start != at:
            what = "overlap" if span.start < at else "leave a hole"
            raise HeaderError(
                f"{label}: safetensors header's data offsets {what} at byte {at - data_start} "
                f"({span.name!r})"
            )
        at = span.stop
    if at != file_bytes:
        raise HeaderError(
            f"{label}: {file_bytes} bytes, its safetensors header describes {at} "
            "(bytes after the last tensor)"
        )
    return Header(metadata, tuple(spans), data_start, file_bytes)


def _span(name: str, entry: Any, data_start: int, file_bytes: int, label: str) -> TensorSpan:
    where = f"{label}: safetensors header entry {name!r}"
    if not isinstance(entry, dict):
        raise HeaderError(f"{where} is not an object")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise HeaderError(f"{where} has an unknown dtype {dtype!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not _sizes(shape) or not _sizes(offsets) or len(offsets) != 2:
        raise HeaderError(f"{where} needs a shape and two data_offsets of non-negative integers")
    begin, end = offsets
    size = nbytes(dtype, shape)
    if end - begin != size:
        raise HeaderError(
            f"{where}: data_offsets {offsets} hold {end - begin} bytes, its shape {shape} "
            f"of {dtype} needs {size}"
        )
    if data_start + end > file_bytes:
        raise HeaderError(f"{where}: data_offsets {offsets} end past the file ({file_bytes} bytes)")
    return TensorSpan(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _sizes(value: Any) -> bool:
    """A list of non-negative integers (``True`` is no size)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)
