"""Node update time: verified reads of a rank's part against a raw read of the same bytes.

A random bf16 Qwen3 snapshot is converted once per tp by the real converter into a
vllm-fused version, whose manifest is then re-digested as format 2 (xxh3-128 blocks of
4 MiB, what the publisher writes from now on); the format-1 manifest (one SHA-256 per file,
what older publishers wrote) is kept beside it for comparison. Each timing starts from a cold
page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``, root only) and reads through
:class:`~weightcast.client.reader.VersionReader` with no Redis, as a vLLM worker does.

Cases, for each tp:

* ``rank 0``: one worker's update: rank 0's tensors, its blocks verified, in memory (at tp 1,
  the whole node's update).
* ``node``: every rank of the node in turn, sharing one node record (each block hashed once).
* ``sha256``: rank 0 of the same file with a format-1 manifest (one SHA-256 per file).

Two baselines replay exactly the reads the verified path made (recorded once per case and
rank: same offsets, same sizes) with ``os.preadv``, with no hashing and no copying out:
``raw`` reads into fresh memory, held until that rank is done (as the verified path holds a
rank's tensors): a plain read of those bytes into memory; ``io`` reads into one reused,
already touched buffer: the disk and the kernel's copy alone, a lower bound. Rounds
interleave the cases and rotate which of the three goes first; medians are printed, with the
median and range of the per-round ratios.

    .venv/bin/python bench/bench_node.py                      # 0.6B, tp 1 2 8, 5 rounds
    .venv/bin/python bench/bench_node.py --shape tiny --rounds 3 --no-drop
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from weightcast.client.confine import OpenFile
from weightcast.client.reader import VersionReader
from weightcast.client.versions import VersionInfo
from weightcast.contract.manifest import MANIFEST_NAME, Manifest, file_entry, sha256_bytes
from weightcast.contract.snapshots import SnapshotInfo
from weightcast.publisher.converter import ConvertOptions, convert
from weightcast.publisher.snapshot_reader import Snapshot

SHAPES = {
    "tiny": dict(layers=2, hidden=128, inter=384, heads=4, kv=2, head_dim=64, vocab=2048),
    "0.6B": dict(layers=28, hidden=1024, inter=3072, heads=16, kv=8, head_dim=128, vocab=151936),
}
KINDS = ("raw", "io", "verify")


def hf_config(s: dict) -> dict:
    return {
        "num_hidden_layers": s["layers"],
        "hidden_size": s["hidden"],
        "intermediate_size": s["inter"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv"],
        "head_dim": s["head_dim"],
        "vocab_size": s["vocab"],
        "tie_word_embeddings": True,
    }


def write_snapshot(path: Path, s: dict) -> Snapshot:
    """A random bf16 snapshot in HF names, as the trainer writes it."""
    gen = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float32).to(torch.bfloat16)

    h, q, kv, inter = s["hidden"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"], s["inter"]
    state = {"model.embed_tokens.weight": rand(s["vocab"], h), "model.norm.weight": rand(h)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}"
        state |= {
            f"{p}.self_attn.q_proj.weight": rand(q, h),
            f"{p}.self_attn.k_proj.weight": rand(kv, h),
            f"{p}.self_attn.v_proj.weight": rand(kv, h),
            f"{p}.self_attn.o_proj.weight": rand(h, q),
            f"{p}.self_attn.q_norm.weight": rand(s["head_dim"]),
            f"{p}.self_attn.k_norm.weight": rand(s["head_dim"]),
            f"{p}.mlp.gate_proj.weight": rand(inter, h),
            f"{p}.mlp.up_proj.weight": rand(inter, h),
            f"{p}.mlp.down_proj.weight": rand(h, inter),
            f"{p}.input_layernorm.weight": rand(h),
            f"{p}.post_attention_layernorm.weight": rand(h),
        }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    (path / "config.json").write_text(json.dumps(hf_config(s)))
    info = SnapshotInfo(uuid.uuid4().hex, "bench", 1, time.time(), "bfloat16", "bench")
    info.write(path)
    return Snapshot(path, info)


def publish(snapshot: Snapshot, weights: Path, tp: int) -> tuple[VersionInfo, VersionInfo]:
    """Version ``tp`` (format 2) and ``100 + tp`` (the same file, format-1 manifest)."""
    published = convert(snapshot, weights, tp, options=ConvertOptions(tp=tp))
    old = weights / f"v{100 + tp}"
    old.mkdir()
    for entry in published.manifest.files:
        os.link(published.path / entry.name, old / entry.name)
    (old / MANIFEST_NAME).write_bytes((published.path / MANIFEST_NAME).read_bytes())
    files = [file_entry(published.path / f.name) for f in published.manifest.files]
    text = dataclasses.replace(published.manifest, files=files).to_json().encode()
    (published.path / MANIFEST_NAME).write_bytes(text)
    return info_of(weights, tp), info_of(weights, 100 + tp)


def info_of(weights: Path, version: int) -> VersionInfo:
    text = (weights / f"v{version}" / MANIFEST_NAME).read_bytes()
    manifest = Manifest.from_json(text)
    return VersionInfo(
        version, f"v{version}", 1, manifest.layout, manifest.tp, manifest.dtype,
        manifest.total_bytes, sha256_bytes(text), "bench", time.time(),
    )  # fmt: skip


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def verified_update(
    weights: Path, info: VersionInfo, ranks: list[int], tp: int, record: Path
) -> Callable[[], int]:
    """The node's update: each rank's tensors in turn, verified, sharing a fresh node record;
    a rank's tensors are dropped before the next rank reads (they would be on a GPU)."""

    def run() -> int:
        shutil.rmtree(record, ignore_errors=True)
        held = 0
        for rank in ranks:
            reader = VersionReader(weights, verified_dir=record)
            parts = reader.rank_tensors(info, rank, tp)
            held += sum(t.nbytes for t in parts.values())
            del parts
        return held

    return run


Reads = list[list[tuple[str, int, int]]]
"""Per rank, the (file, offset, length) reads of one update, in order."""


def recorded_reads(
    weights: Path, info: VersionInfo, ranks: list[int], tp: int, record: Path
) -> Reads:
    """The reads each rank's verified update makes (recorded from a real one)."""
    reads: Reads = []
    read_into = OpenFile.read_into

    def record_read(self: OpenFile, buffers: list[memoryview], offset: int) -> None:
        reads[-1].append((self.label, offset, sum(len(b) for b in buffers)))
        read_into(self, buffers, offset)

    OpenFile.read_into = record_read  # type: ignore[method-assign]
    try:
        shutil.rmtree(record, ignore_errors=True)
        for rank in ranks:
            reads.append([])
            VersionReader(weights, verified_dir=record).rank_tensors(info, rank, tp)
    finally:
        OpenFile.read_into = read_into  # type: ignore[method-assign]
    return reads


def raw_update(reads: Reads, fresh: bool) -> Callable[[], int]:
    """The same reads with ``os.preadv``: each into fresh memory (an anonymous mapping, as a
    large allocation is) held until that rank's reads are done, or (``fresh`` False) all
    into one reused buffer, touched before the clock starts."""
    size = max(length for rank_reads in reads for _, _, length in rank_reads)
    reused = mmap.mmap(-1, size)
    reused.write(b"\1" * size)

    def run() -> int:
        total = 0
        for rank_reads in reads:
            fds: dict[str, int] = {}
            held = []
            try:
                for label, offset, length in rank_reads:
                    if label not in fds:
                        fds[label] = os.open(label, os.O_RDONLY)
                    buffer = mmap.mmap(-1, length) if fresh else reused
                    if fresh:
                        held.append(buffer)
                    view, done = memoryview(buffer)[:length], 0
                    while done < length:
                        done += os.preadv(fds[label], [view[done:]], offset + done)
                    view.release()
                    total += length
            finally:
                for fd in fds.values():
                    os.close(fd)
                for buffer in held:
                    buffer.close()
        return total

    return run


def timed(run: Callable[[], int], drop: bool) -> float:
    drop_caches(drop)
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="0.6B", choices=list(SHAPES))
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: /tmp)")
    parser.add_argument("--no-drop", action="store_true", help="keep the page cache (not root)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    drop = not args.no_drop
    work = Path(tempfile.mkdtemp(prefix="bench-node-", dir=args.dir))
    try:
        snapshot = write_snapshot(work / "step-1", SHAPES[args.shape])
        weights = work / "weights"
        weights.mkdir()
        cases: dict[str, tuple[dict[str, Callable[[], int]], int]] = {}
        for tp in args.tp:
            new, old = publish(snapshot, weights, tp)
            for label, info in (("", new), (" sha256 (format 1)", old)):
                for who, ranks in (("rank 0", [0]), (f"node ({tp} ranks)", list(range(tp)))):
                    if who != "rank 0" and (label or tp == 1):
                        continue
                    verify = verified_update(weights, info, ranks, tp, work / "record")
                    reads = recorded_reads(weights, info, ranks, tp, work / "record")
                    held = verify()
                    cases[f"tp {tp} {who}{label}"] = (
                        {
                            "raw": raw_update(reads, fresh=True),
                            "io": raw_update(reads, fresh=False),
                            "verify": verify,
                        },
                        held,
                    )
        shutil.rmtree(snapshot.path)
        subprocess.run(["sync"], check=True)
        times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in KINDS} for c in cases}
        for round_ in range(args.rounds):
            for name, (runs, _held) in cases.items():
                for index in range(len(KINDS)):
                    kind = KINDS[(index + round_) % len(KINDS)]
                    times[name][kind].append(timed(runs[kind], drop))
            print(f"round {round_ + 1}/{args.rounds} done", flush=True)
        figures = report(cases, times, args)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(cases: dict, times: dict, args: argparse.Namespace) -> list[dict]:
    cache = "cold" if not args.no_drop else "warm"
    print(f"\n{args.shape}, {cache} page cache, {args.rounds} rounds; medians (seconds)")
    print(
        f"{'case':<30} {'in memory':>10} {'raw':>6} {'io':>6} {'verify':>7} "
        f"{'verify/raw per round':>21} {'verify/io per round':>20}"
    )
    figures = []
    for name, (_runs, held) in cases.items():
        t = {kind: times[name][kind] for kind in KINDS}
        row: dict = {"case": name, "held_mb": round(held / 2**20)}
        row |= {f"{kind}_s": statistics.median(t[kind]) for kind in KINDS}
        for base in ("raw", "io"):
            ratios = [v / b for v, b in zip(t["verify"], t[base], strict=True)]
            row[f"verify_{base}"] = (statistics.median(ratios), min(ratios), max(ratios))
        figures.append(row)
        vr, vi = row["verify_raw"], row["verify_io"]
        print(
            f"{name:<30} {row['held_mb']:>7} MB {row['raw_s']:>6.2f} {row['io_s']:>6.2f} "
            f"{row['verify_s']:>7.2f} {vr[0]:>8.2f} ({vr[1]:.2f}-{vr[2]:.2f}) "
            f"{vi[0]:>7.2f} ({vi[1]:.2f}-{vi[2]:.2f})"
        )
    return figures


if __name__ == "__main__":
    main()
