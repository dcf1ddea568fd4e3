"""The safetensors file format, as the trainer writes it and the publisher reads and writes it.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON, then
the data: ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str:
str}}`` with offsets relative to byte ``8 + N``. :func:`read_header` parses a header from
untrusted bytes with bounded sizes and checks it against itself and the file's size, so that
a reader can copy byte ranges out of the file without ever loading it (and without pickle).
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

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The largest header accepted (safetensors' own limit)."""
METADATA_KEY = "__metadata__"


class HeaderError(ValueError):
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


def read_header(fd: int, name: str = "") -> Header:
    """Parse and check the header of the open file ``fd`` (``name`` labels errors).

    The data of every tensor must be exactly ``shape x dtype`` bytes; together they must tile
    the data section with no hole or overlap and end at the end of the file.
    """
    label = name or f"fd {fd}"
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, 8, 0)
    if len(prefix) != 8:
        raise HeaderError(f"{label}: {size} bytes, too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise HeaderError(f"{label}: header length {length} impossible for a {size}-byte file")
    text = os.pread(fd, length, 8)
    if len(text) != length:
        raise HeaderError(f"{label}: file ended inside its header")
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise HeaderError(f"{label}: header is not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise HeaderError(f"{label}: header is not a JSON object")
    metadata = raw.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise HeaderError(f"{label}: __metadata__ must map strings to strings")
    data_start = 8 + length
    spans = sorted(
        (_span(label, tensor, entry, data_start) for tensor, entry in raw.items()),
        key=lambda s: (s.start, s.stop),
    )
    at = data_start
    for span in spans:
        if span.start != at:
            raise HeaderError(f"{label}: data offsets leave a hole or overlap at byte {at}")
        at = span.stop
    if at != size:
        raise HeaderError(f"{label}: {size} bytes, the header describes {at}")
    return Header(metadata, tuple(spans), data_start, size)


def _span(label: str, name: str, entry: Any, data_start: int) -> TensorSpan:
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise ValueError(f"bad data_offsets {offsets!r}")
        begin, end = offsets
        if not (type(begin) is int and type(end) is int and 0 <= begin <= end):
            raise ValueError(f"bad data_offsets {offsets!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise HeaderError(f"{label}: entry {name!r} is malformed: {exc}") from None
    if end - begin != nbytes(dtype, shape):
        raise HeaderError(
            f"{label}: {name} has {end - begin} bytes of data; {dtype} {shape} needs "
            f"{nbytes(dtype, shape)}"
        )
    return TensorSpan(name, dtype, tuple(shape), data_start + begin, data_start + end)
