"""A safetensors header, parsed defensively: every size is checked before anything is sized.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets relative to the end of
the header) and the data. A node reads the header of a file it has not verified yet (its
blocks are checked first when the manifest has block digests), so nothing in it is trusted:
the length must fit the file, every tensor's bytes must equal its shape times its element
size, lie inside the file and overlap no other tensor's. A header claiming 2**62 bytes is a
:class:`WeightsError`, never an allocation.
"""

from __future__ import annotations

import itertools
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

from weightcast.client.confine import json_object
from weightcast.contract.errors import WeightsError

PREFIX_BYTES = 8
MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's own limit on the JSON header."""

DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
}


@dataclass(frozen=True)
class TensorSpan:
    """Where a tensor's bytes are in the file: ``[start, stop)``, row-major."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def dtype_name(self) -> str:
        """The dtype as the manifest writes it (``bfloat16``)."""
        return str(self.dtype).removeprefix("torch.")


def header_bytes(prefix: bytes, file_bytes: int, label: str) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file."""
    if file_bytes < PREFIX_BYTES or len(prefix) != PREFIX_BYTES:
        raise WeightsError(f"{label}: {file_bytes} bytes, too short for a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, file_bytes - PREFIX_BYTES):
        raise WeightsError(
            f"{label}: safetensors header claims {length} bytes; the file has "
            f"{file_bytes - PREFIX_BYTES} after the length (at most {MAX_HEADER_BYTES})"
        )
    return length


def parse_header(text: bytes, file_bytes: int, label: str) -> dict[str, TensorSpan]:
    """Every tensor of the header ``text`` (the ``N`` bytes after the length)."""
    raw = json_object(text, f"{label}: safetensors header")
    data_start = PREFIX_BYTES + len(text)
    spans = {}
    for name, entry in raw.items():
        if name == "__metadata__":
            continue
        spans[name] = _span(name, entry, data_start, file_bytes, label)
    ordered = sorted((s for s in spans.values() if s.stop > s.start), key=lambda s: s.start)
    for before, after in itertools.pairwise(ordered):
        if after.start < before.stop:
            raise WeightsError(
                f"{label}: safetensors header entries {before.name!r} and {after.name!r} overlap"
            )
    return spans


def _span(name: str, entry: Any, data_start: int, file_bytes: int, label: str) -> TensorSpan:
    where = f"{label}: safetensors header entry {name!r}"
    if not isinstance(entry, dict):
        raise WeightsError(f"{where} is not an object")
    dtype = DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise WeightsError(f"{where} has an unknown dtype {entry.get('dtype')!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
        raise WeightsError(f"{where} needs a shape and two data_offsets of non-negative integers")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise WeightsError(
            f"{where}: data_offsets {offsets} hold {end - begin} bytes, its shape {shape} "
            f"of {entry['dtype']} needs {nbytes}"
        )
    if data_start + end > file_bytes:
        raise WeightsError(
            f"{where}: data_offsets {offsets} end past the file ({file_bytes} bytes)"
        )
    return TensorSpan(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )
