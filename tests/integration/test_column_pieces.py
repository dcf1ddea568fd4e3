"""Column pieces (a rank's input columns of a row-parallel weight, per-rank files) copied by the
writer in strided blocks: the file holds exactly those columns, rows straddling a ring buffer's
end included, and its digests are those of its bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from weightcast.contract.manifest import DEFAULT_DIGEST, file_entry
from weightcast_publisher.safetensors_writer import (
    BUFFER_BYTES,
    Columns,
    OutputTensor,
    write_safetensors,
)


def test_column_pieces_are_the_columns_across_buffer_ends(tmp_path: Path) -> None:
    rows, row_bytes, start, width = 6000, 6002, 1002, 3000  # 3000-byte rows do not tile 16 MiB
    table = np.random.default_rng(0).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    source = tmp_path / "source.bin"
    offset = 4096
    source.write_bytes(bytes(offset) + table.tobytes())
    assert rows * width > BUFFER_BYTES and BUFFER_BYTES % width
    pieces = (Columns(source, offset, rows, row_bytes, start, width),) * 2  # two ranks' worth
    out = tmp_path / "out.safetensors"
    entry = write_safetensors(
        out, [OutputTensor("t", "U8", (2 * rows, width), pieces)], DEFAULT_DIGEST
    )
    data = out.read_bytes()
    header = int.from_bytes(data[:8], "little") + 8
    want = np.concatenate([table[:, start : start + width]] * 2)
    assert data[header:] == want.tobytes()
    assert entry.blocks == file_entry(out, DEFAULT_DIGEST).blocks
