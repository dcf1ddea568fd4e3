"""Node update time: verified reads of a rank's part against a raw read of the same bytes.

A random bf16 Qwen3 snapshot (``dcp-safetensors/1``, as the trainer writes it) is published
once per tp by the real converter as a ``vllm-fused`` version (format 2 manifest: xxh3-128
block digests, the blocks the publisher cuts). Each timing starts from a cold page cache
(``sync; echo 3 > /proc/sys/vm/drop_caches``, root only) and reads through the real client,
:meth:`VersionReader.rank_tensors <weightcast.client.reader.VersionReader.rank_tensors>`
with a node record (``verified_dir``) of its own and no Redis, as a vLLM worker does.

Cases, for each tp:

* ``rank 0``: one worker's update: rank 0's tensors, its blocks verified, in memory (at tp 1,
  the whole node's update).
* ``node``: every rank of the node in turn, sharing one node record (each block hashed once;
  a rank's tensors are dropped before the next rank reads, as they would be on a GPU).

Baselines, in the same rounds:

* ``raw``: the rank's own bytes, read with ``os.preadv`` into fresh memory held until that
  rank is done, no hashing, no copying out: each file's header, and for every tensor the
  range from the first to the last byte of the rank's part (its rows; for a column block,
  the rows it spans: all of the tensor). Recorded from the client itself, so both read the
  same parts.
* ``blocks``: the reads the verified path made (whole blocks, recorded from a real update),
  replayed the same way: what block granularity alone costs.

Rounds interleave the cases and rotate which kind goes first; medians are printed, with the
median and range of the per-round ratios, and the bytes each kind reads.

    .venv/bin/python -m bench node                      # 0.6B, tp 1 2 8, 5 rounds
    .venv/bin/python -m bench node --shape tiny --rounds 3 --no-drop
    .venv/bin/python -m bench node --shape 30B-A3B-2L --tp 4 --expert-parallel
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import shutil
import statistics
import struct
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import weightcast.client.reader as reader_module
from bench_publisher import write_template
from common import save_json
from weightcast.client.reader import VersionReader
from weightcast.contract.manifest import MANIFEST_NAME, Manifest, sha256_bytes
from weightcast.contract.model_shape import SHAPES
from weightcast.contract.snapshot_format import FORMAT_DCP_SAFETENSORS, INFO_NAME, SnapshotInfo
from weightcast.contract.version_info import VersionInfo
from weightcast.runtime.durable import write_json
from weightcast.store.directory import OpenFile
from weightcast_publisher.converter import ConvertOptions, convert
from weightcast_publisher.snapshot_scan import Snapshot

KINDS = ("raw", "blocks", "verify")

Reads = list[list[tuple[str, int, int]]]
"""Per rank, the (file, offset, length) reads of one update, in file order."""


def write_snapshot(path: Path, shape: str) -> Snapshot:
    """A random bf16 snapshot in HF names, as the trainer writes it."""
    _, files = write_template(path, SHAPES[shape], FORMAT_DCP_SAFETENSORS)
    info = SnapshotInfo(
        uuid.uuid4().hex, "bench", 1, time.time(), "bfloat16", shape, FORMAT_DCP_SAFETENSORS, files
    )
    write_json(path / INFO_NAME, info.to_json())
    return Snapshot(path, info)


def registered(weights: Path, version: int) -> VersionInfo:
    """The registry entry the publisher would write for ``v<version>``."""
    text = (weights / f"v{version}" / MANIFEST_NAME).read_bytes()
    manifest = Manifest.from_json(text)
    return VersionInfo(
        version=version, path=f"v{version}", step=1, layout=manifest.layout, tp=manifest.tp,
        dtype=manifest.dtype, bytes=manifest.total_bytes, manifest_sha256=sha256_bytes(text),
        run_id="bench", created_at=time.time(),
    )  # fmt: skip


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def verified_update(
    weights: Path, info: VersionInfo, ranks: list[int], tp: int, ep: int, record: Path
) -> Callable[[], int]:
    """The node's update: each rank's tensors in turn, verified, sharing a fresh node record."""

    def run() -> int:
        shutil.rmtree(record, ignore_errors=True)
        read = 0
        for rank in ranks:
            reader = VersionReader(weights, verified_dir=record)
            parts = reader.rank_tensors(info, rank, tp, ep)
            read += reader.stats.bytes_read
            del parts
        return read

    return run


def recorded(
    weights: Path, info: VersionInfo, ranks: list[int], tp: int, ep: int, record: Path
) -> tuple[Reads, Reads, int]:
    """From one real update: per rank, its own byte ranges (headers and the extents of the
    parts the client planned), the block reads the client made; and the bytes it held."""
    own: Reads = []
    blocks: Reads = []
    held = 0
    read_into, plan_part = OpenFile.read_into, reader_module._part
    files: dict[str, str] = {}

    def record_read(self: OpenFile, buffers: list[memoryview], offset: int) -> None:
        blocks[-1].append((self.label, offset, sum(len(b) for b in buffers)))
        files[self.label.rsplit("/", 1)[-1]] = self.label
        read_into(self, buffers, offset)

    def record_part(want, spans, label):  # type: ignore[no-untyped-def]
        part = plan_part(want, spans, label)
        start, stop = part.rect.extent
        own[-1].append((label, start, stop - start))
        return part

    OpenFile.read_into = record_read  # type: ignore[method-assign]
    reader_module._part = record_part
    try:
        shutil.rmtree(record, ignore_errors=True)
        for rank in ranks:
            own.append([])
            blocks.append([])
            parts = VersionReader(weights, verified_dir=record).rank_tensors(info, rank, tp, ep)
            held += sum(t.nbytes for t in parts.values())
    finally:
        OpenFile.read_into = read_into  # type: ignore[method-assign]
        reader_module._part = plan_part
    for rank_reads in own:
        for label in {label for label, _, _ in rank_reads}:
            with open(label, "rb") as f:
                (header,) = struct.unpack("<Q", f.read(8))
            rank_reads.append((label, 0, 8 + header))
        rank_reads[:] = merged(rank_reads)
    return own, [merged(r) for r in blocks], held


def merged(reads: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The same bytes as sorted, non-overlapping reads (touching ones joined)."""
    out: list[tuple[str, int, int]] = []
    for label, offset, length in sorted(reads):
        if out and out[-1][0] == label and offset <= out[-1][1] + out[-1][2]:
            last = out[-1]
            out[-1] = (label, last[1], max(last[2], offset + length - last[1]))
        elif length:
            out.append((label, offset, length))
    return out


def raw_update(reads: Reads) -> Callable[[], int]:
    """The reads with ``os.preadv``, each into fresh memory (an anonymous mapping, as a large
    allocation is) held until that rank's reads are done."""

    def run() -> int:
        total = 0
        for rank_reads in reads:
            fds: dict[str, int] = {}
            held = []
            try:
                for label, offset, length in rank_reads:
                    if label not in fds:
                        fds[label] = os.open(label, os.O_RDONLY)
                    buffer = mmap.mmap(-1, length)
                    held.append(buffer)
                    view, done = memoryview(buffer), 0
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
    parser.add_argument(
        "--expert-parallel", action="store_true", help="MoE shapes: whole experts per rank"
    )
    parser.add_argument(
        "--quantize",
        nargs="+",
        default=["none"],
        choices=["none", "fp8"],
        help="publish a version per tp for each (fp8: publisher.quantize fp8), timed alike",
    )
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: /tmp)")
    parser.add_argument("--no-drop", action="store_true", help="keep the page cache (not root)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    drop = not args.no_drop
    work = Path(tempfile.mkdtemp(prefix="bench-node-", dir=args.dir))
    try:
        snapshot = write_snapshot(work / "step-1", args.shape)
        weights = work / "weights"
        weights.mkdir()
        cases: dict[str, tuple[dict[str, Callable[[], int]], dict[str, int]]] = {}
        pairs = [(tp, q) for tp in args.tp for q in args.quantize]
        for version, (tp, quantize) in enumerate(pairs, start=1):
            options = ConvertOptions(
                tp=tp, expert_parallel=args.expert_parallel, quantize=quantize, delta=False
            )
            convert(snapshot, weights, version, options)
            info = registered(weights, version)
            ep = tp if args.expert_parallel else 1
            kind = "" if quantize == "none" else f" {quantize}"
            for who, ranks in (("rank 0", [0]), (f"node ({tp} ranks)", list(range(tp)))):
                if tp == 1 and who != "rank 0":
                    continue
                verify = verified_update(weights, info, ranks, tp, ep, work / "record")
                own, blocks, held = recorded(weights, info, ranks, tp, ep, work / "record")
                sizes = {
                    "held": held,
                    "raw": sum(n for r in own for _, _, n in r),
                    "blocks": sum(n for r in blocks for _, _, n in r),
                }
                runs = {"raw": raw_update(own), "blocks": raw_update(blocks), "verify": verify}
                cases[f"tp {tp}{kind} {who}"] = (runs, sizes)
        shutil.rmtree(snapshot.path)
        os.sync()
        load = [os.getloadavg()[0]]
        times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in KINDS} for c in cases}
        for round_ in range(args.rounds):
            for name, (runs, _sizes) in cases.items():
                for index in range(len(KINDS)):
                    kind = KINDS[(index + round_) % len(KINDS)]
                    times[name][kind].append(timed(runs[kind], drop))
            load.append(os.getloadavg()[0])
            print(f"round {round_ + 1}/{args.rounds} done, load {load[-1]:.1f}", flush=True)
        figures = report(cases, times, args, load)
        save_json(args.json, figures)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(cases: dict, times: dict, args: argparse.Namespace, load: list[float]) -> dict:
    cache = "cold" if not args.no_drop else "warm"
    machine = f"{platform.node()}, {os.cpu_count()} CPUs"
    loads = f"load average {min(load):.1f}..{max(load):.1f}"
    placement = ", expert parallel" if args.expert_parallel else ""
    print(
        f"\n{machine}; {args.shape}{placement}, {cache} page cache, {args.rounds} rounds, {loads}"
    )
    print(
        f"{'case':<24} {'held MB':>8} {'raw MB':>7} {'blocks MB':>9} {'raw s':>6} "
        f"{'blocks s':>8} {'verify s':>8} {'verify/raw':>17} {'blocks/raw':>17}"
    )
    rows = []
    for name, (_runs, sizes) in cases.items():
        t = times[name]
        row: dict = {"case": name} | {f"{k}_MB": round(v / 1e6) for k, v in sizes.items()}
        row |= {f"{kind}_s": statistics.median(t[kind]) for kind in KINDS}
        for kind in ("verify", "blocks"):
            ratios = [v / b for v, b in zip(t[kind], t["raw"], strict=True)]
            row[f"{kind}_raw"] = (statistics.median(ratios), min(ratios), max(ratios))
        rows.append(row)
        vr, br = row["verify_raw"], row["blocks_raw"]
        print(
            f"{name:<24} {row['held_MB']:>8} {row['raw_MB']:>7} {row['blocks_MB']:>9} "
            f"{row['raw_s']:>6.2f} {row['blocks_s']:>8.2f} {row['verify_s']:>8.2f} "
            f"{vr[0]:>6.2f} ({vr[1]:.2f}-{vr[2]:.2f}) {br[0]:>6.2f} ({br[1]:.2f}-{br[2]:.2f})"
        )
    return {"machine": machine, "shape": args.shape, "cache": cache, "load": load, "cases": rows}


if __name__ == "__main__":
    main()
