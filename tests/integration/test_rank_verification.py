"""A tensor-parallel rank reads only its blocks and verifies exactly those, once per node.

Versions are published by the real publisher (tp 2), then re-digested with small
blocks (so that each rank's rows fill whole blocks of their own). Sibling workers are real
processes sharing a record directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis
import torch

from weightcast.client import block_reads
from weightcast.client import reader as reader_module
from weightcast.client.reader import VersionReader
from weightcast.client.verified import LOCK_NAME, NodeRecord, RecordKey
from weightcast.contract.errors import ConfigError, WeightsError
from weightcast.contract.keys import Keys
from weightcast.contract.manifest import DEFAULT_DIGEST
from weightcast.local.redis_server import RedisServer
from weightcast.store.directory import OpenFile

from helpers.files import REPO
from helpers.models import SMALL_GQA, hf_state
from helpers.versions import Deployment, copy_version, rank_byte_ranges, redigest, register_version
from vllm_reference import qkv_parallel_rank, row_parallel_rank

BLOCK = 256
TP = 2


def redigested(
    deployment: Deployment, block_bytes: int = BLOCK, algorithm: str = DEFAULT_DIGEST
) -> tuple[int, Path]:
    """A copy of v1 with its manifest re-digested (format 2 with ``block_bytes`` blocks, or
    format 1 for ``sha256``), registered; its number and directory."""
    number, directory = copy_version(deployment, 1)
    redigest(directory, algorithm, block_bytes)
    register_version(deployment, number, like=1)
    return number, directory


def needed_blocks(directory: Path, rank: int, block_bytes: int = BLOCK) -> set[int]:
    """The blocks of model.vllm-fused that hold any byte ``rank`` needs."""
    return {
        b
        for s, e in rank_byte_ranges(directory, rank, TP)
        if e > s
        for b in range(s // block_bytes, (e - 1) // block_bytes + 1)
    }


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_each_rank_reads_and_verifies_only_its_blocks(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    number, directory = redigested(deployment)
    weights = directory / "model.vllm-fused"
    reads: list[tuple[int, int]] = []
    read_into = OpenFile.read_into

    def recorded(self: OpenFile, buffers: list[memoryview], offset: int) -> None:
        if self.label.endswith("model.vllm-fused"):
            reads.append((offset, offset + sum(len(b) for b in buffers)))
        read_into(self, buffers, offset)

    monkeypatch.setattr(OpenFile, "read_into", recorded)
    state = hf_state(SMALL_GQA, torch.bfloat16)
    blocks = {rank: needed_blocks(directory, rank) for rank in range(TP)}
    total = -(-weights.stat().st_size // BLOCK)
    assert blocks[0] != blocks[1] and len(blocks[0]) < total and len(blocks[1]) < total
    for rank in range(TP):
        reads.clear()
        reader = deployment.reader(f"node-{rank}")  # a fresh node: nothing verified yet
        parts = reader.rank_tensors(number, rank, TP)
        read = {b for s, e in reads for b in range(s // BLOCK, (e - 1) // BLOCK + 1)}
        assert read == blocks[rank]
        assert reader.reader.stats.blocks_hashed == len(blocks[rank])
        assert reader.reader.stats.blocks_trusted == 0
        layer = "model.layers.0"
        q, k, v = (state[f"{layer}.self_attn.{x}_proj.weight"] for x in "qkv")
        expected_qkv = qkv_parallel_rank(q, k, v, 4, 2, 8, TP, rank)
        assert torch.equal(parts[f"{layer}.self_attn.qkv_proj.weight"], expected_qkv)
        o_proj = f"{layer}.self_attn.o_proj.weight"
        assert torch.equal(parts[o_proj], row_parallel_rank(state[o_proj], TP, rank))
        assert parts[o_proj].is_contiguous()
        # The same node again: nothing hashed twice.
        reader.rank_tensors(number, rank, TP)
        assert reader.reader.stats.blocks_hashed == 0
        assert reader.reader.stats.blocks_trusted == len(blocks[rank])


def test_a_corrupt_block_fails_only_the_ranks_that_read_it(deployment: Deployment) -> None:
    number, directory = redigested(deployment)
    weights = directory / "model.vllm-fused"
    only_rank_1 = sorted(needed_blocks(directory, 1) - needed_blocks(directory, 0))
    assert only_rank_1, "no block is rank 1's alone"
    flip(weights, only_rank_1[len(only_rank_1) // 2] * BLOCK + 7)
    assert len(deployment.reader().rank_tensors(number, 0, TP)) > 10
    with pytest.raises(
        WeightsError, match=r"v\d+/model\.vllm-fused: bytes \d+\.\.\d+ do not match"
    ):
        deployment.reader().rank_tensors(number, 1, TP)
    with pytest.raises(WeightsError, match="do not match"):
        deployment.reader().load(number)
    with pytest.raises(WeightsError, match="do not match"):
        deployment.reader().verify(number)

    shared = sorted(needed_blocks(directory, 0) & needed_blocks(directory, 1))
    flip(weights, only_rank_1[len(only_rank_1) // 2] * BLOCK + 7)  # repaired
    flip(weights, shared[-1] * BLOCK + 3)  # a block both ranks read (a whole row-parallel
    for rank in range(TP):  # tensor, a replicated one or the header)
        with pytest.raises(WeightsError, match="do not match"):
            deployment.reader().rank_tensors(number, rank, TP)


def test_a_format_1_file_is_verified_whole_once_then_read_in_part(
    deployment: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(block_reads, "WHOLE_FILE_GRID", BLOCK)  # a tiny model's file
    number, directory = redigested(deployment, algorithm="sha256")
    reader = deployment.reader()
    size = (directory / "model.vllm-fused").stat().st_size
    reader.rank_tensors(number, 0, TP)
    assert reader.reader.stats.bytes_read >= size  # the whole file, for its sha256
    assert reader.reader.stats.blocks_hashed > 0
    reader.rank_tensors(number, 1, TP)
    assert reader.reader.stats.bytes_read < size  # the sha256 is known good: only rank 1's part
    assert reader.reader.stats.blocks_hashed == 0


WORKER = textwrap.dedent(
    """
    import json, sys
    from weightcast.client.reader import VersionReader
    from weightcast.contract.version_info import VersionInfo

    root, record, version, fields, rank, tp = sys.argv[1:]
    info = VersionInfo.from_fields(int(version), json.loads(fields))
    reader = VersionReader(root, verified_dir=record)
    parts = reader.rank_tensors(info, int(rank), int(tp))
    stats = reader.stats
    print(json.dumps({"tensors": len(parts), "hashed": stats.blocks_hashed,
                      "trusted": stats.blocks_trusted, "read": stats.bytes_read}))
    """
)


def worker(deployment: Deployment, record: Path, version: int, rank: int) -> subprocess.Popen:
    """A vLLM worker's read, in a process of its own: no Redis, the driver's lease info."""
    info = deployment.reader().info(version)
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            WORKER,
            str(deployment.root / "weights"),
            str(record),
            str(version),
            json.dumps(info.as_fields()),
            str(rank),
            str(TP),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sibling_workers_verify_each_block_once_per_node(
    deployment: Deployment, tmp_path: Path
) -> None:
    """Each worker here is a reader of its own sharing the node's record directory, as vLLM's
    worker processes do (the concurrent test below runs them as processes)."""
    number, directory = redigested(deployment)
    record = tmp_path / "node-record"
    info = deployment.reader().info(number)
    blocks = {rank: needed_blocks(directory, rank) for rank in range(TP)}

    def run(rank: int) -> tuple[int, int]:
        reader = VersionReader(deployment.root / "weights", verified_dir=record)
        reader.rank_tensors(info, rank, TP)
        return reader.stats.blocks_hashed, reader.stats.blocks_trusted

    assert run(0) == (len(blocks[0]), 0)
    assert run(1) == (len(blocks[1] - blocks[0]), len(blocks[1] & blocks[0]))
    assert run(0) == (0, len(blocks[0]))  # a restarted worker
    os.utime(directory / "model.vllm-fused")  # a rewritten file voids its record
    assert run(0) == (len(blocks[0]), 0)

    # On disk: one directory per version and manifest digest, one small record per file.
    key = RecordKey(number, info.manifest_sha256)
    entries = sorted(p.name for p in (record / key.dir_name).iterdir())
    assert entries == [LOCK_NAME, "model.vllm-fused.json"]  # config.json: small, read whole
    saved = json.loads((record / key.dir_name / "model.vllm-fused.json").read_text())
    assert set(saved["blocks"]) == blocks[0] and saved["whole"] is False


def test_concurrent_workers_a_killed_lock_holder_and_a_torn_record(
    deployment: Deployment, tmp_path: Path
) -> None:
    number, directory = redigested(deployment)
    record = tmp_path / "node-record"
    key = RecordKey(number, deployment.reader().info(number).manifest_sha256)
    (record / key.dir_name).mkdir(parents=True)
    # A worker killed while it held the record's lock: the lock dies with it.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(600)",
            str(record / key.dir_name / LOCK_NAME),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # A torn record (a crash mid-write of an older layout, a disk error) counts as empty.
    (record / key.dir_name / "model.vllm-fused.json").write_text('{"identity": [1, 2')

    workers = [worker(deployment, record, number, rank) for rank in range(TP)]
    results = []
    for process in workers:
        out, err = process.communicate(timeout=180)
        assert process.returncode == 0, err
        results.append(json.loads(out))
    assert all(r["tensors"] > 10 for r in results)
    saved = json.loads((record / key.dir_name / "model.vllm-fused.json").read_text())
    assert set(saved["blocks"]) == needed_blocks(directory, 0) | needed_blocks(directory, 1)


def test_a_failed_rank_records_nothing_false(deployment: Deployment, tmp_path: Path) -> None:
    number, directory = redigested(deployment)
    record = tmp_path / "node-record"
    only_rank_1 = sorted(needed_blocks(directory, 1) - needed_blocks(directory, 0))
    flip(directory / "model.vllm-fused", only_rank_1[0] * BLOCK + 1)
    reader = VersionReader(deployment.root / "weights", verified_dir=record)
    info = deployment.reader().info(number)
    for _ in range(2):  # the second try hashes the bad block again rather than trusting it
        with pytest.raises(WeightsError, match="do not match"):
            reader.rank_tensors(info, 1, TP)
    # Another manifest under the same version number (a re-registration) shares nothing.
    other = RecordKey(number, "0" * 64)
    assert not (record / other.dir_name).exists()


def test_the_record_directory_must_be_private_to_the_node(tmp_path: Path) -> None:
    shared = tmp_path / "shared-record"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError, match="not be writable by others"):
        NodeRecord(shared)
    link = tmp_path / "link-record"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="not a directory"):
        NodeRecord(link)


def test_only_the_newest_version_records_are_kept(deployment: Deployment, tmp_path: Path) -> None:
    record = NodeRecord(tmp_path / "node-record", keep=2)
    reader = VersionReader(deployment.root / "weights")
    reader.record = record
    numbers = []
    for _ in range(3):
        number, _directory = redigested(deployment)
        reader.rank_tensors(deployment.reader().info(number), 0, TP)
        numbers.append(number)
    kept = sorted(p.name.split("-")[0] for p in record.directory.iterdir())
    assert kept == [f"v{numbers[1]}", f"v{numbers[2]}"]


@pytest.mark.parametrize("keep_base", [False, True])
def test_a_block_changed_after_the_header_was_verified_is_caught_when_read_again(
    client: redis.Redis,
    keys: Keys,
    tmp_path: Path,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    keep_base: bool,
) -> None:
    """At tp 1 the header's block also holds the first tensor's first bytes, and it is read
    twice: for the header, then with the tensors. Bytes that changed in between (a writer
    racing the node) are hashed again, not trusted because the header's read verified them."""
    deployment = Deployment(client, keys, tmp_path, redis_server.url)
    number = deployment.publish()
    weights = deployment.root / "weights" / f"v{number}" / "model.vllm-fused"
    read_header = reader_module.read_header

    def then_changed(f: OpenFile, check: block_reads.Check) -> dict:
        spans = read_header(f, check)
        first = min(span.start for span in spans.values())
        with open(weights, "r+b") as out:
            out.seek(first)
            byte = out.read(1)
            out.seek(first)
            out.write(bytes([byte[0] ^ 0x01]))
        return spans

    monkeypatch.setattr(reader_module, "read_header", then_changed)
    reader = deployment.reader()
    reader.reader.keep_base = keep_base
    with pytest.raises(WeightsError, match="do not match the manifest's xxh3-128 digest"):
        reader.load(number)
