"""Delta math and the manifest's delta, pure: a block's frame (``xor-sparse``, and the
``xor-zstd`` an older publisher wrote) rebuilds the new block from the base exactly; a
damaged or hostile frame, or a base of the wrong size, is refused before a byte of the block
changes; the manifest's ``delta`` is parsed strictly and must match the files it lists."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcast.contract.delta import (
    SPARSE_CODEC,
    ZSTD_CODEC,
    Delta,
    DeltaError,
    DeltaFile,
    apply_block,
    compressor,
    decompressor,
    encode_block,
    encode_zstd_block,
    frame_bound,
    scratch_bytes,
    xor,
)
from weightcast.contract.manifest import BlockDigests, FileEntry, Manifest, ManifestError
from weightcast.contract.sparse_xor import (
    HEADER_BYTES,
    apply_streams,
    check_streams,
    compile_kernels,
    encode_streams,
    payload_bound,
)

SHA = "ab" * 32
ENCODERS: dict[str, Callable[..., bytes]] = {
    SPARSE_CODEC: encode_block,
    ZSTD_CODEC: encode_zstd_block,
}


def nearby(base: bytes, every: int) -> bytes:
    """``base`` with one byte in ``every`` changed, as a small optimizer step changes bf16."""
    changed = bytearray(base)
    changed[::every] = bytes(b ^ 1 for b in changed[::every])
    return bytes(changed)


def block(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8).copy()


@pytest.mark.parametrize("codec", [SPARSE_CODEC, ZSTD_CODEC])
@pytest.mark.parametrize("size", [1 << 16, 4099, 5])  # a multiple of 8, or a short tail
@pytest.mark.parametrize("every", [1, 7, 997, 10**9])
def test_a_block_is_rebuilt_bitwise_from_its_base_and_frame(
    every: int, size: int, codec: str
) -> None:
    base = os.urandom(size)
    new = nearby(base, every)
    frame = ENCODERS[codec](new, base, compressor())
    assert len(frame) <= frame_bound(size, codec)
    assert apply_block(frame, block(base), decompressor(), codec=codec).tobytes() == new
    held = block(base)
    assert apply_block(frame, held, decompressor(), in_place=True, codec=codec) is held
    assert held.tobytes() == new
    apply_block(frame, held, decompressor(), in_place=True, codec=codec)
    assert held.tobytes() == base  # applied again: undone (how a node reverts)
    if every > 100 and size > 4096:
        assert len(frame) < len(new) / 20  # what did not change costs next to nothing


def test_the_zstd_codec_can_write_its_xor_over_the_new_block() -> None:
    base = os.urandom(4096)
    new = block(nearby(base, 7))
    frame = encode_zstd_block(new.tobytes(), base, compressor())
    assert encode_zstd_block(new, base, compressor(), out=new) == frame
    assert new.tobytes() == xor(nearby(base, 7), base).tobytes()


@settings(max_examples=200, deadline=None)
@given(
    base=st.binary(min_size=1, max_size=300),
    changes=st.lists(st.tuples(st.integers(0, 299), st.integers(1, 255)), max_size=80),
)
def test_any_change_of_any_block_round_trips_through_a_sparse_frame(
    base: bytes, changes: list[tuple[int, int]]
) -> None:
    """Every size (tails of 1 to 7 bytes), runs of changed words, changes in the last byte,
    a gap of more than 127 words: the frame rebuilds the block and undoes itself."""
    new = bytearray(base)
    for at, flip in changes:
        new[at % len(base)] ^= flip
    frame = encode_block(bytes(new), base, compressor(), np.empty(2, np.uint8))  # too small
    held = block(base)
    apply_block(frame, held, decompressor(), in_place=True)
    assert held.tobytes() == bytes(new)
    apply_block(frame, held, decompressor(), in_place=True)
    assert held.tobytes() == base


def test_a_gap_longer_than_a_byte_says_is_carried_over() -> None:
    base = bytes(8 * 70000)
    new = bytearray(base)
    new[0], new[8 * 200], new[8 * 69999 + 7] = 1, 2, 3  # gaps of 200 and 69799 words
    frame = encode_block(bytes(new), base, compressor())
    assert apply_block(frame, block(base), decompressor()).tobytes() == bytes(new)


def test_xor_is_its_own_inverse_and_needs_equal_lengths() -> None:
    a, b = os.urandom(64), os.urandom(64)
    assert xor(xor(a, b), b).tobytes() == a
    assert not xor(a, a).any()
    with pytest.raises(DeltaError, match="XOR of 64 bytes with 63"):
        xor(a, b[:63])
    with pytest.raises(DeltaError, match="XOR of 64 bytes with 63"):
        encode_block(a, b[:63], compressor())


@pytest.mark.parametrize("codec", [SPARSE_CODEC, ZSTD_CODEC])
def test_a_cut_frame_or_a_base_of_another_size_is_refused(codec: str) -> None:
    """Frames carry no zstd checksum (the block digests check the result, see
    test_delta_reads): a damaged byte may decode to other bytes, a cut frame does not."""
    base = os.urandom(4096)
    frame = ENCODERS[codec](nearby(base, 5), base, compressor())
    held = block(base)
    with pytest.raises(DeltaError, match="does not decode"):
        apply_block(frame[:-3], held, decompressor(), in_place=True, codec=codec)
    assert held.tobytes() == base  # refused before anything was written
    with pytest.raises(DeltaError):
        apply_block(frame, block(base[:4000]), decompressor(), codec=codec)
    with pytest.raises(DeltaError, match="does not decode"):
        apply_block(b"not zstd", block(base), decompressor(), codec=codec)
    with pytest.raises(DeltaError, match="no codec 'xor-next'"):
        apply_block(frame, block(base), decompressor(), codec="xor-next")


def test_a_zstd_frame_that_declares_asks_or_holds_more_than_its_block_is_refused_cheaply() -> None:
    """The header is read before anything is sized by it, and the output is bounded by the
    block: a frame that declares 4 EiB, asks a 2 GiB window or holds 64 MiB costs a block."""
    base = block(os.urandom(4096))
    frame = encode_zstd_block(nearby(base.tobytes(), 5), base, compressor())
    cases = {
        "declares 4611686018427387904 bytes for a block of 4096": huge_size(frame),
        "declares 4097 bytes": encode_zstd_block(bytes(4097), bytes(4097), compressor()),
        "holds more than the 4096 bytes": BOMB[: frame_bound(4096, ZSTD_CODEC)],
        "asks a window of 2147483648 bytes": wide_window(bytes(4096)),
        "too long for a block of 4096": frame + bytes(frame_bound(4096, ZSTD_CODEC)),
    }
    for message, hostile in cases.items():
        with pytest.raises(DeltaError, match=re.escape(message)):
            apply_block(hostile, base, decompressor(), in_place=True, codec=ZSTD_CODEC)
    scratch = np.empty(8192, np.uint8)
    assert apply_block(frame, base, decompressor(), scratch=scratch, codec=ZSTD_CODEC).size == 4096


def huge_size(frame: bytes) -> bytes:
    """``frame`` with a header that declares 4 EiB of content."""
    return frame[:4] + bytes([0xE0]) + (4 << 60).to_bytes(8, "little") + frame[6:]


def wide_window(data: bytes) -> bytes:
    """A frame of ``data`` that declares no size and asks a 2 GiB window."""
    params = zstandard.ZstdCompressionParameters(window_log=31, strategy=1)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj(size=-1)
    return stream.compress(data) + stream.flush()


def sized_wide_window(size: int) -> bytes:
    """A frame header that declares ``size`` bytes and asks a 2 GiB window (zstd itself
    shrinks the window of a frame whose size it knows): magic, a descriptor for a 4-byte
    size and a window descriptor, the window (2**31: exponent 21), the size, a raw block."""
    magic = (0xFD2FB528).to_bytes(4, "little")
    raw_block = ((size << 3) | 1).to_bytes(3, "little") + bytes(size)  # last, raw
    return magic + bytes([0x80, 21 << 3]) + size.to_bytes(4, "little") + raw_block


def unsized(data: bytes) -> bytes:
    stream = zstandard.ZstdCompressor(level=1).compressobj(size=-1)
    return stream.compress(data) + stream.flush()


BOMB = unsized(bytes(64 << 20))


def payload(changed: int, gaps: bytes, masks: bytes, values: bytes, header: int = -1) -> bytes:
    """A sparse frame of these streams (``header``: another gap-byte count to declare)."""
    counts = np.array([changed, len(gaps) if header < 0 else header, len(values)], "<u4")
    return compressor().compress(counts.tobytes() + gaps + masks + values)


def test_a_sparse_frame_whose_streams_do_not_fit_its_block_is_refused_before_it_changes_it() -> (
    None
):
    """Every rule the decoder checks, each broken by a real zstd frame of a crafted payload:
    the block is untouched by each (they are checked whole before any change), and the
    well-formed frame beside them still applies."""
    base = block(os.urandom(20))  # two whole words and a tail of 4 bytes
    cases = {
        "says 1 words, 2 gap bytes and 1 value bytes, not the 3 bytes": payload(
            1, b"\x01", b"\x01", b"\x07", header=2
        ),
        "its gaps end early": payload(2, b"\x01", b"\x01\x01", b"\x07\x07"),
        "a gap is zero or too long": payload(1, b"\x00", b"\x01", b"\x07"),
        "a gap is zero or too long ": payload(1, b"\x81\x80\x80\x00", b"\x01", b"\x07"),
        "it changes bytes past the block's end": payload(1, b"\x04", b"\x01", b"\x07"),
        "it changes bytes past the block's end ": payload(1, b"\x03", b"\x10", b"\x07"),
        "a word's mask names no byte": payload(1, b"\x01", b"\x00", b""),
        "its gaps hold more than its words": payload(1, b"\x01\x01", b"\x01", b"\x07"),
        "its values are not one per changed byte": payload(1, b"\x01", b"\x03", b"\x07"),
        "less than its header": compressor().compress(b"\x01\x00"),
        "does not declare its size": unsized(payload_of(b"\x01", b"\x01", b"\x07")),
        "declares 400 bytes for a block of 20": compressor().compress(bytes(400)),
        "asks a window of 2147483648 bytes": sized_wide_window(HEADER_BYTES),
        "too long for a block of 20": bytes(frame_bound(20) + 1),
    }
    for message, hostile in cases.items():
        held = base.copy()
        with pytest.raises(DeltaError, match=re.escape(message.strip())):
            apply_block(hostile, held, decompressor(), in_place=True)
        assert held.tobytes() == base.tobytes(), message
    good = payload(2, b"\x01\x02", b"\x01\x08", b"\x07\x09")  # word 0 byte 0, word 2 byte 3
    rebuilt = apply_block(good, base, decompressor()).tobytes()
    expected = bytearray(base.tobytes())
    expected[0] ^= 7
    expected[19] ^= 9
    assert rebuilt == bytes(expected)


def payload_of(gaps: bytes, masks: bytes, values: bytes) -> bytes:
    counts = np.array([len(masks), len(gaps), len(values)], "<u4")
    return counts.tobytes() + gaps + masks + values


def test_a_sparse_frame_is_decoded_into_a_bounded_scratch() -> None:
    """Nothing larger than the bound of a block's payload is decoded, whatever the frame
    says: a 64 MiB bomb costs at most the bound (it declares no size: refused unread)."""
    assert scratch_bytes(4096) == payload_bound(4096) < 2 * 4096
    assert scratch_bytes(4096, ZSTD_CODEC) == 4096
    with pytest.raises(DeltaError, match="does not declare its size"):
        apply_block(BOMB[: frame_bound(4096)], block(bytes(4096)), decompressor())
    sized = compressor().compress(bytes(payload_bound(4096) + 1))
    with pytest.raises(DeltaError, match=f"declares {payload_bound(4096) + 1} bytes"):
        apply_block(sized, block(bytes(4096)), decompressor())


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
    "codec": "xor-sparse",
}


def test_the_manifest_lists_its_delta_and_reads_it_back() -> None:
    manifest = Manifest.from_json(manifest_with(GOOD))
    assert manifest.delta == Delta(3, SHA, "d", [DeltaFile("model.vllm-fused", [5, 0, 7])])
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_a_delta_in_a_codec_this_code_does_not_know_parses_and_says_why_it_cannot_apply() -> None:
    delta = Manifest.from_json(manifest_with({**GOOD, "codec": "xor-next"})).delta
    assert delta is not None and delta.refusal() == (
        "the delta is xor-next, which this node does not read (it reads xor-sparse or xor-zstd)"
    )
    assert Manifest.from_json(manifest_with(GOOD)).delta.refusal() == ""  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"base_version": 4}, "delta.base_version 4 is not before 4"),
        ({"base_version": "3"}, "delta.base_version is '3', not an integer >= 1"),
        ({"base_manifest_sha256": "x"}, "base_manifest_sha256 'x'"),
        ({"codec": "XOR gzip"}, "codec 'XOR gzip' is no codec name"),
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


def test_the_kernels_compiled_ahead_are_the_ones_a_delta_runs() -> None:
    """numba compiles a kernel once per argument type: a read-only block (a writer's buffer,
    a frame's bytes) and a writable one are two. After :func:`compile_kernels` an encode and
    an apply add none, so a publisher's or a node's first delta compiles nothing (a second
    type once cost the first publish its delta: it compiled inside the write)."""
    compile_kernels()
    kernels = (encode_streams, check_streams, apply_streams)
    before = [list(kernel.signatures) for kernel in kernels]
    base = os.urandom(4099)
    frame = encode_block(memoryview(nearby(base, 3)), base, compressor())
    apply_block(frame, block(base), decompressor(), in_place=True)
    assert [list(kernel.signatures) for kernel in kernels] == before
