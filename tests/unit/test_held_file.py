"""A node's held blocks (:class:`HeldFile`): packed in one buffer, runs of consecutive
blocks adjacent and aligned as in the file, so contiguous tensors are views of it."""

from __future__ import annotations

import torch

from weightcast.client.block_reads import Rect
from weightcast.client.delta_reads import HeldFile
from weightcast.client.reader import _held_tensors, _Part

STARTS = [0, 100, 200, 300, 400, 500, 600]
"""Six blocks of 100 bytes: a file of 600."""


def held_file(blocks: list[int]) -> tuple[HeldFile, torch.Tensor]:
    """A HeldFile of ``blocks`` filled from a file whose byte i is i % 251."""
    content = (torch.arange(STARTS[-1]) % 251).to(torch.uint8)
    held = HeldFile.allocate(STARTS, blocks)
    for start, data in held.runs():
        data[:] = content[start : start + len(data)].numpy().tobytes()
    return held, content


def test_runs_are_the_consecutive_blocks_aligned_as_in_the_file() -> None:
    held, _ = held_file([0, 1, 3, 4, 5])
    runs = held.runs()
    assert [(start, len(data)) for start, data in runs] == [(0, 200), (300, 300)]
    assert held.offsets[3] % 64 == 300 % 64


def test_a_span_is_a_view_only_where_every_block_is_held() -> None:
    held, content = held_file([0, 1, 3, 4, 5])
    assert torch.equal(held.span(350, 520), content[350:520])
    assert held.span(150, 320) is None  # block 2 is not held
    view = held.span(300, 308)
    assert view is not None
    view[0] = 7
    assert held.block(3)[0] == 7  # a view, not a copy


def test_a_held_tensor_is_a_view_and_a_column_block_a_copy() -> None:
    held, content = held_file([1, 2, 3, 4])
    rows = Rect(offset=120, rows=1, stride=0, width=200)
    columns = Rect(offset=100, rows=10, stride=40, width=8)  # 8 of 40 bytes, 10 rows
    parts = [
        _Part("rows", torch.bfloat16, (100,), rows),
        _Part("columns", torch.uint8, (10, 8), columns),
    ]
    tensors = _held_tensors(held, parts, "test")
    assert torch.equal(tensors["rows"].view(torch.uint8), content[120:320])
    assert tensors["rows"].data_ptr() == held.span(120, 320).data_ptr()
    expected = content[100:500].view(10, 40)[:, :8]
    assert torch.equal(tensors["columns"], expected)
