"""The delta as the publisher writes it, inside its writer's pipeline: two real snapshots
published by the real converter give, block by block, an empty frame where the block did not
change and zstd of the XOR of the two versions' bytes where it did (one fused file, per-rank
files, blocks cut between ranks, a file linked from the snapshot), which a node holding the
first version applies to end bitwise equal to reading the second in full; FP8 versions the
same way (the XOR of their FP8 bytes and float32 scales). A base with
another plan gives no delta; a base file that is short or gone gives a version without one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from weightcast.client.reader import VersionReader
from weightcast.contract.delta import SPARSE_CODEC, apply_block, decompressor
from weightcast.contract.events import parse_event
from weightcast.contract.keys import Keys
from weightcast.contract.layout import FUSED_WEIGHTS_FILE, LAYOUT_HF
from weightcast.contract.manifest import (
    DEFAULT_DIGEST,
    MANIFEST_NAME,
    BlockDigests,
    FileEntry,
    Manifest,
    sha256_bytes,
    verify_files,
)
from weightcast.contract.nodes import NodeReport
from weightcast.contract.snapshot_format import read_complete
from weightcast.contract.tensorfile import TensorSpan, read_header
from weightcast.contract.version_info import VersionInfo
from weightcast.local.redis_server import RedisServer
from weightcast_publisher.converter import ConvertedVersion, ConvertOptions, convert
from weightcast_publisher.delta_writer import DeltaSink, FileFrames, auto_wait_share, find_base
from weightcast_publisher.safetensors_writer import BUFFER_BYTES, digest_file
from weightcast_publisher.snapshot_scan import Snapshot

from helpers.models import hf_state, shape_of
from helpers.snapshots import write_snapshot
from helpers.versions import Deployment

# Embeddings of 16 MiB each: whole 4 MiB blocks inside them stay unchanged (per rank too).
SHAPE = dataclasses.replace(
    shape_of(8, 8, 32, hidden=256, inter=1024, tied=False), vocab_size=32768
)
KEPT = "model.embed_tokens.weight"
"""The tensor that does not change between the two snapshots: its blocks get empty frames."""


def nudge(state: dict[str, torch.Tensor]) -> None:
    """Move one bf16 value in 37 of every tensor but :data:`KEPT` to its neighbour."""
    for name, tensor in state.items():
        if name != KEPT:
            tensor.view(-1).view(torch.int16)[::37] += 1


def snapshots(tmp_path: Path) -> tuple[Snapshot, Snapshot]:
    state = hf_state(SHAPE, torch.bfloat16)
    first = write_snapshot(tmp_path / "checkpoints", 1, SHAPE, state)
    nudge(state)
    second = write_snapshot(tmp_path / "checkpoints", 2, SHAPE, state)
    return Snapshot(first, read_complete(first)), Snapshot(second, read_complete(second))


def info(published: ConvertedVersion) -> VersionInfo:
    """The registry entry the daemon would write for ``published``."""
    text = (published.path / MANIFEST_NAME).read_bytes()
    m = published.manifest
    return VersionInfo(
        version=m.version, path=published.path.name, step=m.step, layout=m.layout, tp=m.tp,
        dtype=m.dtype, bytes=m.total_bytes, manifest_sha256=sha256_bytes(text),
        run_id=m.run_id, created_at=time.time(),
    )  # fmt: skip


def read(
    reader: VersionReader, version: ConvertedVersion, rank: int, tp: int
) -> dict[str, torch.Tensor]:
    """What a node reads of ``version``: its rank's part, or every tensor of an HF layout."""
    if version.manifest.layout == LAYOUT_HF:
        return reader.load(info(version))
    return reader.rank_tensors(info(version), rank, tp)


def blocks_of(path: Path, blocks: BlockDigests, size: int) -> list[bytes]:
    data = path.read_bytes()
    assert len(data) == size
    return [data[slice(*blocks.span(i, size))] for i in range(len(blocks.digests))]


OPTIONS = {
    "one fused file": ConvertOptions(),
    "blocks cut between 2 ranks": ConvertOptions(tp=2),
    "per-rank files at tp 2": ConvertOptions(tp=2, per_rank_files=True),
    "a file linked from the snapshot": ConvertOptions(layout=LAYOUT_HF),
    "fp8, per-rank files at tp 2": ConvertOptions(tp=2, per_rank_files=True, quantize="fp8"),
    "fp8, the hf layout": ConvertOptions(layout=LAYOUT_HF, quantize="fp8"),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_every_frame_is_the_xor_of_the_two_versions_block(
    tmp_path: Path, options: ConvertOptions
) -> None:
    first, second = snapshots(tmp_path)
    weights = tmp_path / "weights"
    v1 = convert(first, weights, 1, options)
    assert v1.manifest.delta is None  # no base yet
    v2 = convert(second, weights, 2, options)
    verify_files(v2.path, v2.manifest)  # the delta file's own block digests included
    if options.layout == LAYOUT_HF:  # the delta came through the linked file's read
        assert v1.linked == v2.linked == (options.quantize == "none")  # FP8: computed
    delta = v2.manifest.delta
    assert delta is not None and delta.base_version == 1 and delta.codec == SPARSE_CODEC
    assert delta.base_manifest_sha256 == v1.manifest_sha256
    weights_files = sorted({t.file for t in v2.manifest.tensors})
    assert sorted(f.name for f in delta.files) == weights_files
    assert len(weights_files) == (2 if options.per_rank_files else 1)
    stream = (v2.path / delta.file).read_bytes()
    assert len(stream) == delta.bytes
    new_entries = {f.name: f for f in v2.manifest.files}
    old_entries = {f.name: f for f in v1.manifest.files}
    kept = changed = 0
    for name in weights_files:
        new, old = new_entries[name], old_entries[name]
        assert new.blocks is not None and old.blocks is not None
        new_blocks = blocks_of(v2.path / name, new.blocks, new.bytes)
        old_blocks = blocks_of(v1.path / name, old.blocks, old.bytes)
        for i, (offset, length) in enumerate(delta.frames(name)):
            if new.blocks.digests[i] == old.blocks.digests[i]:
                assert length == 0, (name, i)
                kept += 1
                continue
            frame = stream[offset : offset + length]
            old_block = np.frombuffer(old_blocks[i], np.uint8)
            rebuilt = apply_block(frame, old_block, decompressor(), codec=delta.codec)
            assert rebuilt.tobytes() == new_blocks[i], (name, i)
            if len(new_blocks[i]) >= 4096:  # only what changed (beyond zstd's framing)
                assert length < len(new_blocks[i]) / 4
            changed += 1
    assert kept and changed  # blocks inside the unchanged embedding, and the rest

    for rank in range(options.tp):  # each rank's node holds v1's part, then reads v2's
        holder = VersionReader(weights, keep_base=True)
        read(holder, v1, rank, options.tp)
        by_delta = read(holder, v2, rank, options.tp)
        assert holder.stats.via == "delta", holder.stats.reason
        full = read(VersionReader(weights), v2, rank, options.tp)
        assert by_delta.keys() == full.keys()
        assert all(torch.equal(by_delta[k], full[k]) for k in full)


def no_delta_reason(caplog: pytest.LogCaptureFixture) -> str:
    reasons = [
        r.wc_fields["reason"]  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "no delta"
    ]
    assert len(reasons) == 1, reasons
    return reasons[0]


def test_a_base_with_other_tensors_gives_no_delta_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = snapshots(tmp_path)
    convert(first, tmp_path / "weights", 1, ConvertOptions(tp=2))
    with caplog.at_level(logging.INFO, "weightcast.publisher"):
        v2 = convert(second, tmp_path / "weights", 2, ConvertOptions(tp=1))
    assert v2.manifest.delta is None
    assert no_delta_reason(caplog) == "the base has other tensors (names, shapes, dtypes or shards)"
    assert sorted(p.name for p in v2.path.iterdir() if p.name.startswith("delta")) == []


def test_a_base_file_with_other_digests_gives_no_delta_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Same tensors and blocks, another digest algorithm: found when the file is planned."""
    first, second = snapshots(tmp_path)
    convert(first, tmp_path / "weights", 1, ConvertOptions(digest="blake3"))
    with caplog.at_level(logging.INFO, "weightcast.publisher"):
        v2 = convert(second, tmp_path / "weights", 2, ConvertOptions())
    assert v2.manifest.delta is None
    assert no_delta_reason(caplog) == "model.vllm-fused has blake3 digests in the base"
    verify_files(v2.path, v2.manifest)


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_base_file_short_or_gone_gives_a_version_without_a_delta(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    first, second = snapshots(tmp_path)
    v1 = convert(first, tmp_path / "weights", 1)
    base_file = v1.path / FUSED_WEIGHTS_FILE
    if damage == "truncated":
        os.truncate(base_file, base_file.stat().st_size - 4096)
    else:
        base_file.unlink()
    with caplog.at_level(logging.INFO, "weightcast.publisher"):
        v2 = convert(second, tmp_path / "weights", 2)
    assert v2.manifest.delta is None
    assert FUSED_WEIGHTS_FILE in no_delta_reason(caplog)
    assert not list(v2.path.glob("delta-*"))
    verify_files(v2.path, v2.manifest)


class Opened:
    """The file sink a test opened itself (so it can damage the base in between)."""

    def __init__(self, frames: FileFrames | None) -> None:
        self.frames = frames

    def file(self, name: str, size: int, blocks: BlockDigests) -> FileFrames | None:
        return self.frames


def frames_for(
    tmp_path: Path, v1: ConvertedVersion, v2: ConvertedVersion
) -> tuple[DeltaSink, FileFrames, FileEntry]:
    """A delta from ``v1`` written into a fresh folder, the encoder of ``v2``'s fused file's
    frames (fed by hand), and that file's entry."""
    base = find_base(tmp_path / "weights", 2)
    assert base is not None and base.path == v1.path
    out = tmp_path / "out"
    out.mkdir()
    sink = DeltaSink(out, base, v1.manifest.tensors, [FUSED_WEIGHTS_FILE], DEFAULT_DIGEST)
    entry = next(f for f in v2.manifest.files if f.name == FUSED_WEIGHTS_FILE)
    assert entry.blocks is not None
    frames = sink.file(FUSED_WEIGHTS_FILE, entry.bytes, entry.blocks)
    assert frames is not None
    return sink, frames, entry


def spans_of(path: Path) -> list[TensorSpan]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return list(read_header(fd, str(path)).tensors)
    finally:
        os.close(fd)


def test_a_base_file_truncated_while_the_version_is_written_drops_only_the_delta(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The pipeline's threads meet the short base mid-file: the file's digests are still
    right and the pipeline ends; the delta is dropped, its file removed."""
    first, second = snapshots(tmp_path)
    v1 = convert(first, tmp_path / "weights", 1)
    v2 = convert(second, tmp_path / "weights", 2, ConvertOptions(delta=False))
    name = FUSED_WEIGHTS_FILE
    sink, frames, entry = frames_for(tmp_path, v1, v2)
    os.truncate(v1.path / name, BUFFER_BYTES)  # the first buffer's blocks are still there
    with caplog.at_level(logging.INFO, "weightcast.publisher"):
        digested = digest_file(
            v2.path / name, spans_of(v2.path / name), DEFAULT_DIGEST, name, Opened(frames)
        )
        assert sink.finish() is None
    assert digested == entry
    assert no_delta_reason(caplog) == f"{name}: the base's {name} is shorter than its manifest says"
    assert list(sink.path.parent.iterdir()) == []


def test_frames_fed_out_of_order_are_written_in_block_order(tmp_path: Path) -> None:
    """Buffers reach the delta in any order (several hash threads); the file is in order."""
    first, second = snapshots(tmp_path)
    v1 = convert(first, tmp_path / "weights", 1)
    v2 = convert(second, tmp_path / "weights", 2)
    assert v2.manifest.delta is not None
    name = FUSED_WEIGHTS_FILE
    sink, frames, entry = frames_for(tmp_path, v1, v2)
    data = memoryview((v2.path / name).read_bytes())
    buffers = range(0, entry.bytes, BUFFER_BYTES)
    assert len(buffers) >= 2
    for offset in reversed(buffers):
        stop = min(offset + BUFFER_BYTES, entry.bytes)
        blocks = entry.blocks.block_range(offset, stop)
        frames.take(offset, data[offset:stop], blocks, entry.blocks.digests)
    finished = sink.finish()
    assert finished is not None
    delta, delta_entry = finished
    assert delta == dataclasses.replace(v2.manifest.delta, files=delta.files)
    assert delta.files == v2.manifest.delta.files
    written = (sink.path.parent / delta.file).read_bytes()
    assert written == (v2.path / delta.file).read_bytes()
    assert delta_entry == next(f for f in v2.manifest.files if f.name == delta.file)
    assert Manifest.read(v2.path).delta == delta


def cached_bytes(path: Path) -> int:
    """How many of ``path``'s first bytes are in the page cache (a read that may not wait
    for the disk: ``RWF_NOWAIT``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        at, size = 0, os.fstat(fd).st_size
        buffer = bytearray(1024 * 1024)
        while at < size:
            try:
                n = os.preadv(fd, [buffer], at, os.RWF_NOWAIT)
            except BlockingIOError:
                break
            if n <= 0:
                break
            at += n
        return at
    finally:
        os.close(fd)


@pytest.mark.parametrize("delta", [True, False])
def test_with_deltas_on_each_version_is_read_back_into_the_page_cache_as_the_next_base(
    client: redis.Redis, keys: Keys, tmp_path: Path, redis_server: RedisServer, delta: bool
) -> None:
    """The writer writes with O_DIRECT (the version is on the disk only); with deltas on,
    the publisher then reads it into the page cache in the background, so the next
    version's delta reads its base from memory. Without deltas it does not."""
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        pytest.skip(f"{tmp_path} takes no O_DIRECT: every write lands in the page cache there")
    deployment = Deployment(client, keys, tmp_path, redis_server.url, shape=SHAPE)
    publisher = deployment.publisher
    publisher.publishing.options = dataclasses.replace(publisher.publishing.options, delta=delta)
    version = deployment.publish()
    weights = tmp_path / "weights" / f"v{version}" / FUSED_WEIGHTS_FILE
    if delta:
        assert publisher.publishing.warming is not None
        publisher.publishing.warming.join(timeout=120)
        assert cached_bytes(weights) == weights.stat().st_size
    else:
        assert publisher.publishing.warming is None
        assert cached_bytes(weights) < weights.stat().st_size


def redraw(state: dict[str, torch.Tensor]) -> None:
    """New random values everywhere: a version that shares nothing with the one before."""
    gen = torch.Generator().manual_seed(1)
    for tensor in state.values():
        tensor.copy_(torch.randn(tensor.shape, generator=gen))


CHANGES = {
    "a small change keeps its delta": (nudge, ""),
    "every value moved drops it": (redraw, "the delta"),
}
DROPPED = ("the delta stopped paying", "the delta's encoding fell behind the write")
"""Why a version that shares nothing with its base has no delta: whichever budget ran out
first (its frames' size, judged after 16 MiB, or the encoding of random bytes, slower than
the write)."""


@pytest.mark.parametrize("change, reason", CHANGES.values(), ids=CHANGES.keys())
def test_the_registry_says_why_a_version_has_no_delta_and_no_partial_delta_is_left(
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    change: Callable[[dict[str, torch.Tensor]], None],
    reason: str,
) -> None:
    """A delta larger than half the bytes it covers is not worth a node's XOR: the publisher
    stops encoding it, removes what it wrote of it, and says so in the log, the registry
    entry, the published event and a counter; a small change still gets its delta."""
    deployment = Deployment(client, keys, tmp_path, redis_server.url, shape=SHAPE)
    publisher = deployment.publisher
    events = client.pubsub()
    events.subscribe(keys.events)
    state = hf_state(SHAPE, torch.bfloat16)
    for step in (1, 2):
        if step == 2:
            change(state)
        write_snapshot(tmp_path / "checkpoints", step, SHAPE, state)
        with caplog.at_level(logging.INFO, "weightcast.publisher"):
            publisher.scan_once()
    first = VersionInfo.from_fields(1, client.hgetall(keys.version(1)))
    second = VersionInfo.from_fields(2, client.hgetall(keys.version(2)))
    messages = iter(lambda: events.get_message(timeout=1), None)
    announced = [parse_event(m["data"]) for m in messages if m["type"] == "message"]
    events.close()
    assert [(e.version, e.delta_bytes, e.no_delta) for e in announced] == [
        (1, 0, ""),
        (2, second.delta_bytes, second.no_delta),
    ]
    assert first.no_delta == ""  # no base: nothing was dropped
    directory = tmp_path / "weights" / second.path
    written = sorted(p.name for p in directory.iterdir() if p.name.startswith("delta-"))
    dropped = sum(
        publisher.metrics.registry.get_sample_value(name, {"reason": kind}) or 0
        for name, kind in [("weightcast_deltas_dropped_total", k) for k in ("too_large", "behind")]
    )
    if not reason:
        assert (second.delta_from, second.no_delta) == (1, "")
        assert 0 < second.delta_bytes < second.bytes // 10
        assert written == ["delta-from-v1.xor-sparse"] and dropped == 0
        return
    assert (second.delta_from, second.delta_bytes) == (0, 0)
    assert second.no_delta.startswith(DROPPED), second.no_delta
    assert no_delta_reason(caplog) == second.no_delta
    assert written == [] and dropped == 1
    assert Manifest.read(directory).delta is None
    verify_files(directory, Manifest.read(directory))
    assert not list((tmp_path / "weights").glob(".tmp-*"))


@pytest.mark.parametrize("behind", ["drop", "wait"])
def test_an_encoding_slower_than_the_ring_drops_the_delta_and_its_file_unless_told_to_wait(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, behind: str
) -> None:
    """The pipeline with no write at all (``digest_file``: the writer is done with every
    buffer at once) over a file of more buffers than the ring, half of the values moved at
    random places (encoding a block whose every word changed costs some 5 ms, the copy from
    the page cache well under 1 ms; the size budget is lifted so that it does not end the
    delta first):
    the filling thread soon waits on a buffer only the encoding holds, and the delta is
    dropped rather than slow the write; with ``delta_behind = "wait"`` the write waits and
    the whole delta is kept."""
    big = dataclasses.replace(SHAPE, vocab_size=8 * 32768)  # 2 x 128 MiB embeddings: 17 buffers
    state = hf_state(big, torch.bfloat16)
    first = write_snapshot(tmp_path / "checkpoints", 1, big, state)
    gen = torch.Generator().manual_seed(1)
    for tensor in state.values():
        flat = tensor.view(-1).view(torch.int16)
        flat ^= (torch.rand(flat.shape, generator=gen) < 0.5).to(torch.int16)
    second = write_snapshot(tmp_path / "checkpoints", 2, big, state)
    v1 = convert(Snapshot(first, read_complete(first)), tmp_path / "weights", 1)
    options = ConvertOptions(delta=False)
    v2 = convert(Snapshot(second, read_complete(second)), tmp_path / "weights", 2, options)
    name = FUSED_WEIGHTS_FILE
    for path in (v1.path / name, v2.path / name):
        path.read_bytes()  # in the page cache: the copy is far faster than the encoding
    sink, frames, entry = frames_for(tmp_path, v1, v2)
    assert entry.bytes > 6 * BUFFER_BYTES
    sink.max_ratio = 1.0
    sink.behind_rule = behind
    with caplog.at_level(logging.INFO, "weightcast.publisher"):
        spans = spans_of(v2.path / name)
        digested = digest_file(v2.path / name, spans, DEFAULT_DIGEST, name, Opened(frames))
        kept = sink.finish()
    assert digested == entry  # the version's own digests are whole
    if behind == "wait":
        assert kept is not None and sink.kind == "" and sink.covered == entry.bytes
        _, delta_entry = kept
        assert sink.path.stat().st_size == delta_entry.bytes > 0
        return
    assert kept is None
    assert no_delta_reason(caplog).startswith("the delta's encoding fell behind the write")
    assert sink.kind == "behind"
    assert list(sink.path.parent.iterdir()) == []


def test_auto_allows_a_third_of_the_write_per_live_node_and_at_most_all_of_it() -> None:
    assert [round(auto_wait_share(n), 3) for n in (0, 1, 2, 3, 50)] == [0.333, 0.333, 0.667, 1, 1]


def test_the_publisher_counts_the_nodes_that_report(
    redis_server: RedisServer, client: redis.Redis, keys: Keys, tmp_path: Path
) -> None:
    deployment = Deployment(client, keys, tmp_path, redis_server.url, shape=SHAPE)
    assert deployment.publisher.publishing.live_nodes() == 0
    for node in ("a", "b", "c"):
        client.hset(keys.nodes, node, NodeReport(1, time.time()).encode())
    assert deployment.publisher.publishing.live_nodes() == 3


def test_auto_lets_the_write_wait_on_the_encoding_for_a_third_of_its_time(
    tmp_path: Path,
) -> None:
    """``delta_behind = "auto"``: the waits the pipeline reports add up, and the delta is
    dropped once they pass a third of the time since the version's write began (a tenth of a
    second is always allowed); ``drop`` ends it at the first wait, ``wait`` never."""
    first, second = snapshots(tmp_path)
    v1 = convert(first, tmp_path / "weights", 1)
    v2 = convert(second, tmp_path / "weights", 2, ConvertOptions(delta=False))
    sink, frames, _ = frames_for(tmp_path, v1, v2)
    assert sink.behind_rule == "auto"
    sink.started = time.monotonic() - 3  # the write began three seconds ago
    frames.behind(0.6)
    frames.behind(0.35)
    assert sink.reason == ""  # 0.95 s of 3
    frames.behind(0.1)
    assert sink.kind == "behind"
    assert re.search(r"held the write 1\.050 s of 3\.0[0-9]+ s", sink.reason), sink.reason
    assert list(sink.path.parent.iterdir()) == []
    for rule, waits, dropped in (
        ("auto", [0.09], False),  # the floor
        ("auto", [0.09, 0.02], True),
        ("drop", [0.001], True),
        ("wait", [100.0], False),
    ):
        shutil.rmtree(tmp_path / "out")
        sink, frames, _ = frames_for(tmp_path, v1, v2)
        sink.behind_rule = rule
        for seconds in waits:
            frames.behind(seconds)
        assert (sink.kind == "behind") == dropped, (rule, waits, sink.reason)
        sink.close()


def test_a_delta_that_stops_paying_is_dropped_after_its_first_16_mib(tmp_path: Path) -> None:
    """Frames fed in order by one thread (no ring, so nothing falls behind) for a version
    whose values were all redrawn: once they cover 16 MiB and hold more than half of it, the
    delta is dropped, the later buffers are not encoded, and its file is removed."""
    first, _ = snapshots(tmp_path)
    state = hf_state(SHAPE, torch.bfloat16)
    redraw(state)
    path = write_snapshot(tmp_path / "checkpoints", 3, SHAPE, state)
    v1 = convert(first, tmp_path / "weights", 1)
    options = ConvertOptions(delta=False)
    v2 = convert(Snapshot(path, read_complete(path)), tmp_path / "weights", 2, options)
    name = FUSED_WEIGHTS_FILE
    sink, frames, entry = frames_for(tmp_path, v1, v2)
    assert entry.blocks is not None and entry.bytes > 2 * BUFFER_BYTES
    data = memoryview((v2.path / name).read_bytes())
    for offset in range(0, entry.bytes, BUFFER_BYTES):
        stop = min(offset + BUFFER_BYTES, entry.bytes)
        frames.take(
            offset, data[offset:stop], entry.blocks.block_range(offset, stop), entry.blocks.digests
        )
        if offset == 0:
            assert sink.reason.startswith("the delta stopped paying: its frames hold"), sink.reason
            assert sink.kind == "too_large" and sink.covered == BUFFER_BYTES
    assert sink.covered == BUFFER_BYTES  # nothing encoded after the drop
    assert sink.finish() is None
    assert list(sink.path.parent.iterdir()) == []
