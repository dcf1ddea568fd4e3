"""safetensors headers from untrusted bytes: bounded, checked against themselves and the file."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightcast.contract.tensorfile import (
    HeaderError,
    encode_header,
    file_order,
    header_length,
    parse_header,
    read_header,
)


def header_of(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_header(fd, path.name)
    finally:
        os.close(fd)


def raw_file(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    prefix = struct.pack("<Q", len(text) if length is None else length)
    path.write_bytes(prefix + text + data)
    return path


def test_the_header_is_what_save_file_writes(tmp_path: Path) -> None:
    tensors = {
        "b.weight": torch.ones(3, 4, dtype=torch.bfloat16),
        "a.norm": torch.ones(5, dtype=torch.float32),
        "layers.10.x": torch.zeros(2, dtype=torch.bfloat16),
        "layers.2.x": torch.zeros(2, dtype=torch.bfloat16),
    }
    save_file(tensors, str(tmp_path / "ref.safetensors"), {"format": "pt"})
    order = file_order(
        (n, {torch.bfloat16: "BF16", torch.float32: "F32"}[t.dtype]) for n, t in tensors.items()
    )
    header = encode_header([(n, d, tuple(tensors[n].shape)) for n, d in order], {"format": "pt"})
    reference = (tmp_path / "ref.safetensors").read_bytes()
    assert reference.startswith(header)
    parsed = header_of(tmp_path / "ref.safetensors")
    assert [s.name for s in parsed.tensors] == [n for n, _ in order]
    assert parsed.tensors[0].start == len(header) and parsed.file_bytes == len(reference)


ENTRY = {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("header", "data", "length", "error"),
    [
        (b"", b"", 10**12, "header claims 1000000000000 bytes"),
        (b"{not json", b"", None, "not JSON"),
        (b"[" * 100_000, b"", None, "not JSON"),  # a RecursionError, not a crash
        (b"\xff{", b"", None, "not JSON"),
        (b"[1, 2]", b"", None, "not a JSON object"),
        ({"t": [1, 2]}, bytes(8), None, "entry 't' is not an object"),
        ({"t": {**ENTRY, "dtype": "Q7"}}, bytes(8), None, "unknown dtype 'Q7'"),
        ({"t": {**ENTRY, "dtype": ["F32"]}}, bytes(8), None, "unknown dtype"),
        ({"t": {**ENTRY, "shape": [2, -2]}}, bytes(8), None, "non-negative integers"),
        ({"t": {**ENTRY, "shape": [True, 8]}}, bytes(8), None, "non-negative integers"),
        ({"t": {"dtype": "BF16", "shape": [4]}}, bytes(8), None, "two data_offsets"),
        ({"t": {**ENTRY, "data_offsets": [0, 6]}}, bytes(6), None, "hold 6 bytes.* needs 8"),
        ({"t": {**ENTRY, "data_offsets": [8, 0]}}, bytes(8), None, "hold -8 bytes"),
        (
            {"t": {**ENTRY, "shape": [2**40, 2**40], "data_offsets": [0, 2**81]}},
            bytes(8),
            None,
            "end past the file",
        ),
        ({"t": ENTRY, "u": {**ENTRY, "data_offsets": [10, 18]}}, bytes(18), None, "hole"),
        ({"t": ENTRY, "u": {**ENTRY, "data_offsets": [4, 12]}}, bytes(12), None, "overlap"),
        ({"t": ENTRY}, bytes(9), None, r"\d+ bytes, its safetensors header describes \d+ "),
        ({"t": ENTRY}, bytes(7), None, "end past the file"),
        ({"__metadata__": {"k": 1}, "t": ENTRY}, bytes(8), None, "strings to strings"),
    ],
)
def test_malformed_headers_are_refused_with_the_reason(
    tmp_path: Path, header: object, data: bytes, length: int | None, error: str
) -> None:
    path = raw_file(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(HeaderError, match=f"bad.safetensors: .*{error}"):
        header_of(path)


def test_the_length_is_checked_against_the_file_before_anything_is_sized() -> None:
    with pytest.raises(HeaderError, match="claims 4611686018427387904 bytes"):
        header_length(struct.pack("<Q", 2**62), 10_000, "f")
    with pytest.raises(HeaderError, match="claims 100000001 bytes"):  # safetensors' own limit
        header_length(struct.pack("<Q", 100_000_001), 200_000_000, "f")
    assert header_length(struct.pack("<Q", 100), 108, "f") == 100
    with pytest.raises(HeaderError, match="claims 101 bytes"):
        header_length(struct.pack("<Q", 101), 108, "f")
    with pytest.raises(HeaderError, match="2 bytes, too short"):
        header_length(b"\1\2", 2, "f")


def test_a_good_header_gives_spans_in_file_order_from_the_bytes_alone() -> None:
    """What a node parses: header bytes it has verified, and the file's size."""
    text = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "b": {"dtype": "F32", "shape": [], "data_offsets": [12, 16]},
            "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
            "empty": {"dtype": "F32", "shape": [0, 4], "data_offsets": [16, 16]},
        }
    ).encode()
    header = parse_header(text, 8 + len(text) + 16, "f")
    start = 8 + len(text)
    assert header.metadata == {"format": "pt"} and header.data_start == start
    assert [(s.name, s.dtype, s.shape, s.start, s.stop) for s in header.tensors] == [
        ("a", "BF16", (2, 3), start, start + 12),
        ("b", "F32", (), start + 12, start + 16),
        ("empty", "F32", (0, 4), start + 16, start + 16),
    ]
