"""safetensors headers from untrusted bytes: bounded, checked against themselves and the file."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightcast.contract.tensorfile import HeaderError, encode_header, file_order, read_header


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
        (b"", b"", 10**12, "impossible"),
        (b"{not json", b"", None, "not JSON"),
        (b"[1, 2]", b"", None, "not a JSON object"),
        ({"t": {**ENTRY, "dtype": "Q7"}}, bytes(8), None, "unknown dtype"),
        ({"t": {**ENTRY, "shape": [2, -2]}}, bytes(8), None, "bad shape"),
        ({"t": {**ENTRY, "data_offsets": [0, 6]}}, bytes(6), None, "needs 8"),
        ({"t": ENTRY, "u": {**ENTRY, "data_offsets": [10, 18]}}, bytes(18), None, "hole"),
        ({"t": ENTRY, "u": {**ENTRY, "data_offsets": [4, 12]}}, bytes(12), None, "overlap"),
        ({"t": ENTRY}, bytes(9), None, "the header describes"),
        ({"t": ENTRY}, bytes(7), None, "the header describes"),
        ({"__metadata__": {"k": 1}, "t": ENTRY}, bytes(8), None, "strings to strings"),
    ],
)
def test_malformed_headers_are_refused_with_the_reason(
    tmp_path: Path, header: object, data: bytes, length: int | None, error: str
) -> None:
    path = raw_file(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(HeaderError, match=error):
        header_of(path)


def test_a_file_too_short_for_a_header_is_refused(tmp_path: Path) -> None:
    (tmp_path / "short").write_bytes(b"\x01\x02")
    with pytest.raises(HeaderError, match="too short"):
        header_of(tmp_path / "short")
