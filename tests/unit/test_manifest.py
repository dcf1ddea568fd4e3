"""Manifest digests: fixed and layout-cut blocks, format 1 whole-file sha256, damage found."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from weightcast.contract.manifest import (
    BlockDigests,
    FileEntry,
    Manifest,
    ManifestError,
    digest_bytes,
    file_entry,
    sha256_file,
    verify_files,
)
from weightcast.contract.untrusted import MAX_VALUES


def blocks_of(data: bytes, lengths: list[int] | None, block_bytes: int) -> BlockDigests:
    cuts = lengths or [block_bytes] * (-(-len(data) // block_bytes))
    digests, at = [], 0
    for n in cuts:
        digests.append(digest_bytes("xxh3-128", data[at : at + n]))
        at += n
    return BlockDigests("xxh3-128", block_bytes, digests, lengths)


@pytest.mark.parametrize("lengths", [None, [3, 1, 4, 2]])
def test_a_byte_range_maps_to_exactly_the_blocks_that_hold_it(lengths: list[int] | None) -> None:
    data = bytes(range(10))
    blocks = blocks_of(data, lengths, 4)
    entry = FileEntry("f", len(data), blocks=blocks)
    for start in range(10):
        for stop in range(start + 1, 11):
            chosen = list(blocks.block_range(start, stop))
            spans = [blocks.span(i, len(data)) for i in chosen]
            assert spans[0][0] <= start and spans[-1][1] >= stop  # covers the range
            assert all(lo < stop and hi > start for lo, hi in spans)  # and nothing more
    for index in range(len(blocks.digests)):
        lo, hi = blocks.span(index, len(data))
        entry.verify_block(index, data[lo:hi])
    first = blocks.span(0, len(data))
    with pytest.raises(ManifestError, match=rf"f: bytes 0\.\.{first[1]} do not match"):
        entry.verify_block(0, b"\x00\x01\x03")


def test_blocks_that_do_not_tile_the_file_are_refused() -> None:
    with pytest.raises(ManifestError, match="do not tile"):
        FileEntry("f", 10, blocks=BlockDigests("xxh3-128", 4, ["a", "b"]))
    with pytest.raises(ManifestError, match="do not tile"):
        FileEntry("f", 10, blocks=BlockDigests("xxh3-128", 4, ["a", "b", "c"], [4, 5, 1]))
    with pytest.raises(ManifestError, match="block digests or a sha256"):
        FileEntry("f", 10)


def test_format_1_and_format_2_manifests_verify_and_find_damage(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x" * 10_000)
    (tmp_path / "b.bin").write_bytes(b"y" * 100)
    old = FileEntry("a.bin", 10_000, sha256=sha256_file(tmp_path / "a.bin"))
    manifest = Manifest(1, 1, "run", "snap", "vllm-fused", 1, "bfloat16", [old])
    manifest.files.append(file_entry(tmp_path / "b.bin"))
    read_back = Manifest.from_json(manifest.to_json())
    assert read_back.files == manifest.files
    verify_files(tmp_path, read_back)
    for older in ("weightcast.manifest/1", "weightcast.manifest/2"):
        legacy = manifest.to_json().replace("weightcast.manifest/3", older)
        verify_files(tmp_path, Manifest.from_json(legacy))
    (tmp_path / "b.bin").write_bytes(b"y" * 99 + b"z")
    with pytest.raises(ManifestError, match=r"b\.bin: bytes 0\.\.100 do not match"):
        verify_files(tmp_path, read_back)


def test_a_newer_manifest_format_tells_the_operator_to_upgrade_the_node() -> None:
    manifest = Manifest(1, 1, "run", "snap", "vllm-fused", 1, "bfloat16")
    newer = manifest.to_json().replace("weightcast.manifest/3", "weightcast.manifest/4")
    with pytest.raises(
        ManifestError,
        match=r"manifest format 'weightcast.manifest/4' is not one this weightcast reads "
        r"\(weightcast.manifest/1, weightcast.manifest/2, weightcast.manifest/3\): "
        r"upgrade weightcast on this node",
    ):
        Manifest.from_json(newer)


@pytest.mark.parametrize("item", [b"[]", b'"a"', b"{}", b"1000"])
def test_a_manifest_of_two_million_tiny_values_is_refused_before_it_is_parsed(
    item: bytes,
) -> None:
    """Two to four bytes of input would be 28 to 72 bytes of Python each: the values are
    counted first, so the refusal costs nothing like the 64 MiB they would take."""
    count = MAX_VALUES
    text = b'{"files": [' + b",".join([item] * count) + b"]}"
    tracemalloc.start()
    try:
        with pytest.raises(ManifestError, match=f"JSON values, more than the {MAX_VALUES}"):
            Manifest.from_json(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < len(text), peak
