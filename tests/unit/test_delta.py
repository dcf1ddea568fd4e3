"""Delta math and the manifest's delta, pure: XOR + zstd per block rebuilds the new block
from the base exactly; a damaged frame or a base of the wrong size is refused; the manifest's
``delta`` is parsed strictly and must match the files it lists."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import zstandard

from weightcast.contract.delta import (
    Delta,
    DeltaError,
    DeltaFile,
    apply_block,
    compressor,
    decompressor,
    encode_block,
    frame_bound,
    xor,
)
from weightcast.contract.manifest import BlockDigests, FileEntry, Manifest, ManifestError

SHA = "ab" * 32


def nearby(base: bytes, every: int) -> bytes:
    """``base`` with one byte in ``every`` changed, as a small optimizer step changes bf16."""
    changed = bytearray(base)
    changed[::every] = bytes(b ^ 1 for b in changed[::every])
    return bytes(changed)


def block(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).copy()


@pytest.mark.parametrize("size", [1 << 16, 4099])  # a multiple of 8 or not
@pytest.mark.parametrize("every", [1, 7, 997, 10**9])
def test_a_block_is_rebuilt_bitwise_from_its_base_and_frame(every: int, size: int) -> None:
    base = os.urandom(size)
    new = nearby(base, every)
    frame = encode_block(new, base, compressor())
    assert apply_block(frame, block(base), decompressor()).tobytes() == new
    scratch = block(new)
    assert encode_block(scratch, base, compressor(), out=scratch) == frame  # XOR over new
    held = block(base)
    assert apply_block(frame, held, decompressor(), in_place=True) is held
    assert held.tobytes() == new
    if every > 100:
        assert len(frame) < len(new) / 20  # mostly zero bytes compress well


def test_xor_is_its_own_inverse_and_needs_equal_lengths() -> None:
    a, b = os.urandom(64), os.urandom(64)
    assert xor(xor(a, b), b).tobytes() == a
    assert not xor(a, a).any()
    with pytest.raises(DeltaError, match="XOR of 64 bytes with 63"):
        xor(a, b[:63])


def test_a_cut_frame_or_a_base_of_another_size_is_refused() -> None:
    """Frames carry no zstd checksum (the block digests check the result, see
    test_delta_reads): a damaged byte may decode to other bytes, a cut frame does not."""
    base = os.urandom(4096)
    frame = encode_block(nearby(base, 5), base, compressor())
    held = block(base)
    with pytest.raises(DeltaError, match="does not decode"):
        apply_block(frame[:-3], held, decompressor(), in_place=True)
    assert held.tobytes() == base  # refused before anything was written
    good = encode_block(nearby(base, 5), base, compressor())
    with pytest.raises(DeltaError):
        apply_block(good, block(base[:4000]), decompressor())
    with pytest.raises(DeltaError, match="does not decode"):
        apply_block(b"not zstd", block(base), decompressor())


def test_a_frame_that_declares_asks_or_holds_more_than_its_block_is_refused_cheaply() -> None:
    """The header is read before anything is sized by it, and the output is bounded by the
    block: a frame that declares 4 EiB, asks a 2 GiB window or holds 64 MiB costs a block."""
    base = block(os.urandom(4096))
    frame = encode_block(nearby(base.tobytes(), 5), base, compressor())
    too_long = zstandard.ZstdCompressor(level=1).compressobj(size=-1)
    bomb = too_long.compress(bytes(64 << 20)) + too_long.flush()
    assert zstandard.get_frame_parameters(bomb).content_size == zstandard.CONTENTSIZE_UNKNOWN
    huge_window = zstandard.ZstdCompressor(
        compression_params=zstandard.ZstdCompressionParameters(window_log=31, strategy=1)
    ).compressobj(size=-1)
    wide = huge_window.compress(bytes(4096)) + huge_window.flush()
    cases = {
        "declares 4611686018427387904 bytes for a block of 4096": (
            frame[:4] + bytes([0xE0]) + (4 << 60).to_bytes(8, "little") + frame[6:]
        ),
        "declares 4097 bytes": encode_block(bytes(4097), bytes(4097), compressor()),
        "holds more than the 4096 bytes of its block": bomb[: frame_bound(4096)],
        "asks a window of 2147483648 bytes": wide,
        "too long for a block of 4096": frame + bytes(frame_bound(4096)),
    }
    for message, hostile in cases.items():
        with pytest.raises(DeltaError, match=re.escape(message)):
            apply_block(hostile, base, decompressor(), in_place=True)
    assert apply_block(frame, base, decompressor(), scratch=np.empty(8192, np.uint8)).size == 4096


def test_frames_lie_one_after_another_in_file_and_block_order() -> None:
    delta = Delta(3, SHA, "d", [DeltaFile("a", [5, 0, 7]), DeltaFile("b", [0, 2])])
    assert delta.bytes == 14
    assert delta.frames("a") == [(0, 5), (5, 0), (5, 7)]
    assert delta.frames("b") == [(12, 0), (12, 2)]
    assert delta.frames("c") == []


def manifest_with(delta: dict) -> str:
    blocks = BlockDigests("xxh3-128", 4, ["0", "1", "2"])
    files = [FileEntry("model.vllm-fused", 10, blocks=blocks), FileEntry("d", 12, blocks=blocks)]
    raw = json.loads(Manifest(4, 4, "run", "snap", "vllm-fused", 1, "bfloat16", files).to_json())
    raw["delta"] = delta
    return json.dumps(raw)


GOOD = {
    "base_version": 3,
    "base_manifest_sha256": SHA,
    "file": "d",
    "files": [{"name": "model.vllm-fused", "lengths": [5, 0, 7]}],
    "codec": "xor-zstd",
}


def test_the_manifest_lists_its_delta_and_reads_it_back() -> None:
    manifest = Manifest.from_json(manifest_with(GOOD))
    assert manifest.delta == Delta(3, SHA, "d", [DeltaFile("model.vllm-fused", [5, 0, 7])])
    assert Manifest.from_json(manifest.to_json()) == manifest


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"base_version": 4}, "delta.base_version 4 is not before 4"),
        ({"base_version": "3"}, "delta.base_version is '3', not an integer >= 1"),
        ({"base_manifest_sha256": "x"}, "base_manifest_sha256 'x'"),
        ({"codec": "xor-gzip"}, "codec 'xor-gzip' is not xor-zstd"),
        ({"file": "e"}, "delta.file 'e' is not listed with the 12 bytes of its frames"),
        ({"files": [{"name": "model.vllm-fused", "lengths": [12]}]}, "one frame length per block"),
        ({"files": [{"name": "config.json", "lengths": [5, 0, 7]}]}, "(config.json) is not"),
        ({"files": [{"name": "model.vllm-fused", "lengths": [5, 0, -7]}]}, "lengths is"),
        ({"extra": 1}, "delta has unknown fields ['extra']"),
    ],
)
def test_a_malformed_delta_is_refused_naming_the_field(change: dict, message: str) -> None:
    with pytest.raises(ManifestError, match=re.escape(message)):
        Manifest.from_json(manifest_with({**GOOD, **change}))
