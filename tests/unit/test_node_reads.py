"""The pure parts of a node's reads: registered paths, copying a rank's bytes out of read
windows, and the registry entry (safetensors headers: tests/unit/test_tensorfile.py)."""

from __future__ import annotations

import ctypes
import itertools
import random
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch

from weightcast.client.block_reads import Rect, _Ring, copy_rect
from weightcast.client.reader import Want, _part
from weightcast.contract.errors import RedisFull, WeightsError
from weightcast.contract.manifest import TensorEntry
from weightcast.contract.sharding import RankSlice, Shard, ShardKind
from weightcast.contract.tensorfile import TensorSpan
from weightcast.contract.version_info import VersionInfo
from weightcast.runtime.retry import Outage, redis_full
from weightcast.store.directory import registered_parts

ROOT = Path("/data/weights")


@pytest.mark.parametrize(
    ("path", "parts"),
    [
        ("v17", ("v17",)),
        ("runs/v17", ("runs", "v17")),
        ("/data/weights/v17", ("v17",)),
        ("/mnt/link/v17", ("v17",)),  # the root as configured, before resolving a symlink
    ],
)
def test_registered_paths_become_plain_names_below_the_root(path: str, parts: tuple) -> None:
    assert registered_parts(path, ROOT, Path("/mnt/link")) == parts


@pytest.mark.parametrize(
    "path",
    ["/data/weights", "/data/weightsX/v1", "/etc", "../v1", "v1/..", "v1/./x", "v1//x", "", "/"],
)
def test_registered_paths_that_escape_or_are_not_plain_are_refused(path: str) -> None:
    with pytest.raises(WeightsError, match="refusing to read it"):
        registered_parts(path, ROOT, ROOT)


def test_copying_a_rect_window_by_window_gives_the_rect() -> None:
    """Rows and column blocks of a file, copied out of any split of the file into windows,
    equal the same bytes sliced at once."""
    rng = random.Random(0)
    for _ in range(300):
        rows, stride = rng.randint(1, 9), rng.randint(1, 40)
        width = rng.randint(1, stride)
        offset = rng.randint(0, 50)
        rect = Rect(offset, rows, stride if rows > 1 else 0, width)
        data = bytes(rng.randrange(256) for _ in range(offset + rows * stride + 30))
        expected = b"".join(
            data[offset + r * stride : offset + r * stride + width] for r in range(rows)
        )
        out = torch.zeros(rows * width, dtype=torch.uint8)
        cuts = sorted({0, len(data), *(rng.randint(1, len(data) - 1) for _ in range(4))})
        for start, stop in itertools.pairwise(cuts):
            copy_rect(rect, start, memoryview(bytearray(data[start:stop])), out)
        assert bytes(out.tolist()) == expected, (rect, cuts)


def test_the_scratch_ring_never_hands_out_bytes_still_taken() -> None:
    """Windows in flight each read into their piece of one ring while the caller verifies
    the oldest: two pieces sharing a byte would let a read overwrite verified bytes."""
    rng = random.Random(0)
    ring = _Ring(100)
    base = ctypes.addressof(ctypes.c_char.from_buffer(ring._buffer))
    taken: deque[range] = deque()
    wrapped = 0
    for _ in range(5000):
        length = rng.randint(1, 100)
        piece = ring.take(length) if rng.random() < 0.6 or not taken else None
        if piece is None:
            if taken:
                taken.popleft()
                ring.release()
            else:
                pytest.fail(f"an empty ring refused {length} of its 100 bytes")
            continue
        at = ctypes.addressof(ctypes.c_char.from_buffer(piece)) - base
        new = range(at, at + length)
        assert len(piece) == length and new.stop <= 100
        assert all(new.stop <= old.start or old.stop <= new.start for old in taken)
        wrapped += bool(taken) and at < taken[-1].start
        taken.append(new)
    assert wrapped > 100


def test_a_registry_entry_is_parsed_with_errors_naming_the_field() -> None:
    fields = {
        "path": "v3",
        "step": "9",
        "layout": "vllm-fused",
        "tp": "2",
        "dtype": "bfloat16",
        "bytes": "100",
        "manifest_sha256": "a" * 64,
        "run_id": "r",
        "created_at": "1.5",
    }
    info = VersionInfo.from_fields(3, {k.encode(): v.encode() for k, v in fields.items()})
    assert (info.path, info.tp, info.created_at) == ("v3", 2, 1.5)
    assert VersionInfo.from_fields(3, info.as_fields()) == info
    with pytest.raises(WeightsError, match="has no 'path'"):
        VersionInfo.from_fields(3, {k: v for k, v in fields.items() if k != "path"})
    with pytest.raises(WeightsError, match="bytes is 'lots', not a int"):
        VersionInfo.from_fields(3, {**fields, "bytes": "lots"})
    assert (info.delta_from, info.delta_bytes) == (0, 0)  # an older publisher writes neither
    delta = {**fields, "delta_from": "2", "delta_bytes": "40"}
    assert VersionInfo.from_fields(3, delta).delta_from == 2
    with pytest.raises(WeightsError, match="delta_from is '-1', not a int"):
        VersionInfo.from_fields(3, {**delta, "delta_from": "-1"})
    with pytest.raises(WeightsError, match="delta_from 3 with delta_bytes 40"):
        VersionInfo.from_fields(3, {**delta, "delta_from": "3"})
    with pytest.raises(WeightsError, match="delta_from 0 with delta_bytes 40"):
        VersionInfo.from_fields(3, {**delta, "delta_from": "0"})


def raising(exc: Exception) -> Callable[[], None]:
    def call() -> None:
        raise exc

    return call


def test_a_full_redis_is_waited_out_like_an_outage_then_named() -> None:
    full = redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
    in_script = redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'.")
    assert redis_full(full) and redis_full(in_script)
    assert not redis_full(redis.ResponseError("WRONGTYPE")) and not redis_full(ValueError())
    outage = Outage(budget=60)
    pauses: list[float] = []
    assert not outage.attempt(raising(full), "pushing", pauses.append)
    assert outage.ongoing and outage.detail()["redis"] == "full" and pauses == [0.5]
    assert outage.attempt(lambda: None, "pushing", pauses.append)
    assert outage.detail() == {"redis": "ok"}
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        outage.attempt(raising(redis.ResponseError("WRONGTYPE")), "x", print)
    spent = Outage(budget=0)
    with pytest.raises(RedisFull, match="Redis is full and refuses writes while pushing"):
        spent.attempt(raising(full), "pushing", pauses.append)


def test_a_rank_part_past_its_tensor_is_refused_before_any_read() -> None:
    """The last guard: whatever computed the part, a rect reaching past the tensor (into
    bytes its verified blocks may not cover) is never planned."""
    entry = TensorEntry("model.norm.weight", "f", [128], "bfloat16", Shard(ShardKind.REPLICATED))
    spans = {entry.name: TensorSpan(entry.name, "BF16", (128,), 64, 64 + 256)}
    with pytest.raises(WeightsError, match=r"f: tensor model\.norm\.weight \[128\] has no part"):
        _part(Want(entry, RankSlice(0, 0, 4096)), spans, "f")
    assert _part(Want(entry, RankSlice(0, 64, 128)), spans, "f").rect == Rect(192, 1, 0, 128)
