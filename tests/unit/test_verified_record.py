"""The node-private record of verified blocks: whatever its files hold, a record that cannot
be read is no record (the blocks are verified again), never an exception."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightcast.client.verified import NodeRecord, RecordKey, Verified
from weightcast.store.base import Identity

KEY = RecordKey(1, "0" * 64)
IDENTITY: Identity = ("file", 1, 2, 3, 4, 5)
FILE = "model.safetensors"


@pytest.mark.parametrize("garbage", ["[" * 100_000, "[0, 1]", "{", '{"blocks": "01"}'])
def test_an_unreadable_record_is_no_record(tmp_path: Path, garbage: str) -> None:
    record = NodeRecord(tmp_path / "record")
    record.add(KEY, FILE, IDENTITY, Verified(frozenset({0, 1})))
    assert record.known(KEY, FILE, IDENTITY) == Verified(frozenset({0, 1}))
    (tmp_path / "record" / KEY.dir_name / f"{FILE}.json").write_text(garbage)
    assert record.known(KEY, FILE, IDENTITY) == Verified()
