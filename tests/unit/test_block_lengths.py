"""Where the publisher cuts a file's digest blocks (``safetensors_writer.block_lengths``)."""

from __future__ import annotations

import itertools

from weightcast.contract.manifest import BLOCK_BYTES
from weightcast_publisher.safetensors_writer import BUFFER_BYTES, block_lengths

MIB = 1024 * 1024


def starts(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


def test_one_reader_throughout_is_the_fixed_grid() -> None:
    for size in (0, 1, BLOCK_BYTES, 3 * BUFFER_BYTES + 5):
        assert block_lengths(size, [(0, size, "all")]) is None
        assert block_lengths(size, [(0, 7, "all"), (7, size, "all")]) is None


def test_blocks_are_cut_where_the_readers_change_and_at_every_buffer() -> None:
    size = 2 * BUFFER_BYTES + 8 * MIB
    rank_rows = [(100 + r * 5 * MIB, 100 + (r + 1) * 5 * MIB, frozenset({r})) for r in range(7)]
    readers = [(0, 100, "all"), *rank_rows, (rank_rows[-1][1], size, "all")]
    lengths = block_lengths(size, readers)
    assert lengths is not None and sum(lengths) == size
    assert all(0 < n <= BLOCK_BYTES for n in lengths)
    cuts = set(starts(lengths))
    assert {start for start, _, _ in readers} <= cuts
    assert set(range(0, size, BUFFER_BYTES)) <= cuts
    # Nothing else: each run between two required cuts is split into whole 4 MiB blocks
    # and one shorter remainder at most.
    required = sorted({start for start, _, _ in readers} | set(range(0, size, BUFFER_BYTES)))
    assert len(lengths) == sum(
        -(-(hi - lo) // BLOCK_BYTES) for lo, hi in itertools.pairwise([*required, size])
    )


def test_neighbours_with_the_same_readers_share_blocks() -> None:
    size = 3 * MIB
    readers = [(0, 10, "all"), (10, 20, "all"), (20, MIB, frozenset({0})), (MIB, size, "all")]
    assert block_lengths(size, readers) == [20, MIB - 20, 2 * MIB]
