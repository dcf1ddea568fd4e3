"""Delta versions: their size on a real training run, what they cost the publisher, and a
node's update by delta against by the full version.

``train``: the real trainer (``--model small``, its AdamW, a bf16 snapshot every step) and
the real publisher (deltas on) on a private redis-server, once per ``--lrs``; prints per lr
the median over versions of the delta's size over the full version's (the registry's
``delta_bytes`` against the bytes of the version's own files), with min..max.

``node``: a bf16 snapshot of ``--shape`` (random values, as bench_publisher writes them) and
a copy of it with ``--changed`` of its values moved to a bf16 neighbour (what a small step
does). The converter publishes the first as v1; then each round publishes the second three
times against the same base v1, the pages of both snapshots warm (as after a trainer write):
with a delta and v1 dropped from the page cache first (``cold base``: the publisher writes
with ``O_DIRECT``, so its previous version is on disk only unless a node on the same machine
read it), with a delta and v1 in the page cache (``warm base``: the cold publish just read
it), and without a delta; then a node reads it: a node holding
v1 (``keep_base``) by delta against a fresh node by the full version, both with the version's
files dropped from the page cache first (``posix_fadvise DONTNEED``: a cold cache without
root). Prints medians and the median of the per-round ratios (delta / full).

``publish`` (issue 29): per ``--change-rates`` (percent of the bf16 values moved by one ulp at
random places, as an Adam step moves a bf16 copy; 100: new random values, a version that
shares nothing with the last), the publisher with its defaults (deltas on) and with
``--no-delta`` against ``cp`` + ``fsync`` of the same bytes, in the same rounds, each in each
place of the round in turn.
Each publish runs ``convert`` in a process of its own (no torch imported: its peak RSS is the
publisher's) with the base v1 and the new snapshot in the page cache, as the daemon keeps
them (it reads each version back after publishing it). Then a node that holds v1 reads the
version (by delta if it has one, else in full) and a fresh node reads the one published
without a delta, the version's pages dropped first: end-to-end freshness is the publish plus
the read. The delta's size is also computed offline (XOR + zstd of every changed block), so
a delta the publisher dropped still has a size to report.

    .venv/bin/python -m bench delta train --lrs 1e-6 1e-5 --steps 8
    .venv/bin/python -m bench delta node --shape 0.6B --rounds 5
    .venv/bin/python -m bench delta publish --shape 0.6B --change-rates 3 15 100 --rounds 5
    .venv/bin/python -m bench delta chain --shape 0.6B --behind 3 --rounds 5

``chain`` (issue 30): v1 from a random bf16 snapshot of ``--shape``, then ``--behind``
versions each with ``--changed`` of the values moved one ulp at random places (a new place
for each version), published by the converter with deltas on. Each round a node holding v1
(``keep_base``) reads the newest by the chain of deltas (``links``: the versions between),
against a fresh node reading it in full, every version's files dropped from the page cache
first. Prints medians, the bytes each read, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

import numpy as np
import redis
import torch

from bench_node import registered, write_snapshot
from common import (
    REPO,
    drop_pages,
    med,
    ratio,
    raw_copy,
    save_json,
    spread,
    timed,
    weightcast_env,
)
from weightcast.client.producer import BatchProducer
from weightcast.client.reader import VersionReader
from weightcast.contract.delta import compressor, encode_block
from weightcast.contract.keys import Keys
from weightcast.contract.manifest import Manifest
from weightcast.contract.model_shape import SHAPES
from weightcast.contract.snapshot_format import SnapshotInfo
from weightcast.contract.version_info import VersionInfo
from weightcast.local.produce import synthetic_batch
from weightcast.local.redis_server import RedisServer
from weightcast_publisher.converter import ConvertOptions, convert
from weightcast_publisher.snapshot_scan import Snapshot
from weightcast_trainer.model import flavor_args


def train(args: argparse.Namespace) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        for lr in args.lrs:
            ratios = train_once(server.url, Path(tmp), lr, args)
            results.append({"lr": lr, "ratios": ratios})
            print(
                f"lr {lr:g}: {len(ratios)} deltas, median {statistics.median(ratios):.2%} of the "
                f"full version (min {min(ratios):.2%}, max {max(ratios):.2%})",
                flush=True,
            )
    return results


def train_once(redis_url: str, workdir: Path, lr: float, args: argparse.Namespace) -> list[float]:
    """One training run at ``lr``; each published version's delta size over its full size."""
    namespace = f"delta-{uuid.uuid4().hex[:8]}"
    producer = BatchProducer(redis_url, namespace, name="bench", max_pending=0)
    generator = torch.Generator().manual_seed(0)
    vocab = flavor_args(args.model).vocab_size
    for _ in range(args.steps):
        producer.push(synthetic_batch(generator, args.batch_size, args.seq_len, vocab), 0)
    run_dir = workdir / namespace
    run_dir.mkdir()
    env = weightcast_env(redis_url, namespace, run_dir / "checkpoints", run_dir / "weights")
    weightcast = [sys.executable, "-m", "weightcast"]
    publisher = subprocess.Popen(
        [*weightcast, "publisher", "--rescan-seconds", "0.2", "--keep", str(args.steps + 2)],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(run_dir / "publisher.log", "w"),  # noqa: SIM115 (closed with the process)
    )
    try:
        trainer = subprocess.run(
            [
                *weightcast,
                "trainer",
                "--model",
                args.model,
                "--lr",
                str(lr),
                "--steps",
                str(args.steps),
                "--publish-every",
                "1",
                "--seq-len",
                str(args.seq_len),
            ],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if trainer.returncode != 0:
            raise SystemExit(f"trainer failed:\n{trainer.stderr[-3000:]}")
        client = redis.Redis.from_url(redis_url)
        keys = Keys(namespace)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            latest = int(client.get(keys.latest) or 0)
            if latest and int(client.hget(keys.version(latest), "step")) == args.steps:
                break
            time.sleep(0.5)
        ratios = []
        for raw in client.zrange(keys.versions, 0, -1):
            fields = client.hgetall(keys.version(int(raw)))
            delta = int(fields.get(b"delta_bytes", 0))
            if int(fields.get(b"delta_from", 0)):
                ratios.append(delta / (int(fields[b"bytes"]) - delta))
        client.close()
        return ratios
    finally:
        publisher.terminate()
        publisher.wait(timeout=60)
        shutil.rmtree(run_dir, ignore_errors=True)


def nudge(values: torch.Tensor, fraction: float) -> None:
    """Move ``fraction`` of the bf16 values ``values`` (their bits as a flat int16 tensor)
    to a neighbouring bf16 value, in place: what a small optimizer step does to a bf16 copy.
    Nudging twice restores the values (the same positions flip back)."""
    every = max(1, round(1 / fraction))
    values[::every] ^= 1  # the lowest mantissa bit: a neighbouring bf16 value


def changed_copy(source: Path, target: Path, fraction: float) -> Snapshot:
    """``source``'s snapshot with ``fraction`` of its bf16 values moved by one ulp."""
    nudged_copy(source, target, fraction)
    return Snapshot(target, SnapshotInfo.read(target))


def nudged_copy(source: Path, target: Path, fraction: float) -> None:
    """Copy the snapshot directory ``source`` with ``fraction`` of the bf16 values of its
    safetensors files moved by one ulp (:func:`nudge`), a chunk at a time: an 8B snapshot
    is 16 GB. The chunks hold a whole number of nudge strides, so the values moved are those
    one :func:`nudge` of the whole file moves."""
    target.mkdir()
    chunk = 2 * max(1, round(1 / fraction)) * (1 << 20)
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy2(path, target / path.name)
            continue
        with open(path, "rb") as src, open(target / path.name, "wb") as dst:
            head = src.read(8)
            dst.write(head + src.read(int.from_bytes(head, "little")))
            while data := bytearray(src.read(chunk)):
                nudge(torch.frombuffer(data, dtype=torch.int16), fraction)
                dst.write(data)
            dst.flush()
            os.fsync(dst.fileno())


def moved_copy(source: Path, target: Path, percent: float, seed: int = 1) -> Snapshot:
    """``source``'s snapshot with ``percent`` of its bf16 values moved one ulp at random
    places (the lowest mantissa bit flipped), or all of them redrawn at 100 (random bits,
    the exponent's top bit cleared as ``bench_publisher.random_state`` draws them)."""
    shutil.copytree(source, target)
    info = SnapshotInfo.read(target)
    rng = np.random.default_rng(seed)
    chunk = 1 << 24
    for entry in info.files:
        path = target / entry.name
        data = bytearray(path.read_bytes())
        header = 8 + int.from_bytes(data[:8], "little")
        values = np.frombuffer(memoryview(data)[header:], np.uint16)
        for at in range(0, values.size, chunk):
            part = values[at : at + chunk]
            if percent >= 100:
                part[:] = rng.integers(0, 1 << 16, part.size, dtype=np.uint16) & 0xBFFF
                continue
            where = np.flatnonzero(rng.random(part.size, np.float32) < percent / 100)
            part[where] ^= 1  # one ulp up or down, never across an exponent (to NaN)
        path.write_bytes(data)
    return Snapshot(target, info)


def warm(directory: Path) -> None:
    """Read every file of ``directory`` into the page cache."""
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(16 << 20):
                    pass


def offline_delta_bytes(new: Path, base: Path) -> int:
    """The delta's size had every changed block been encoded: zstd (the publisher's level)
    of the XOR of each block whose digest changed, over every weights file."""
    manifest, old = Manifest.read(new), Manifest.read(base)
    zstd, total = compressor(), 0
    for entry in manifest.files:
        before = next((f for f in old.files if f.name == entry.name), None)
        if entry.blocks is None or before is None or before.blocks is None:
            continue
        a, b = (new / entry.name).read_bytes(), (base / entry.name).read_bytes()
        for i, digest in enumerate(entry.blocks.digests):
            if digest != before.blocks.digests[i]:
                lo, hi = entry.blocks.span(i, entry.bytes)
                total += len(encode_block(a[lo:hi], b[lo:hi], zstd))
    return total


ONCE = """
import json, sys, time
from pathlib import Path
from weightcast_publisher.converter import ConvertOptions, convert
from weightcast_publisher.snapshot_scan import Snapshot
from weightcast.contract.snapshot_format import SnapshotInfo
snapshot, weights, delta = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "on"
behind = sys.argv[4]
if delta:  # as the daemon does at its start
    from weightcast.contract.sparse_xor import compile_kernels
    compile_kernels()
start = time.perf_counter()
published = convert(Snapshot(snapshot, SnapshotInfo.read(snapshot)), weights, 2,
                    ConvertOptions(delta=delta, delta_behind=behind))
seconds = time.perf_counter() - start
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
delta = published.manifest.delta
print(json.dumps({"seconds": seconds, "rss_mb": int(hwm.split()[1]) / 1024,
                  "delta_bytes": delta.bytes if delta else 0,
                  "no_delta": getattr(published, "no_delta", "")}))
"""
"""One publish of ``argv[1]`` as v2 into ``argv[2]``, deltas ``on`` or off (``argv[4]``: the
``delta_behind`` rule), in a process without torch: its time, peak RSS and delta."""


def publish_once(
    snapshot: Path, weights: Path, delta: bool, code: Path | None = None, behind: str = "auto"
) -> dict:
    """``ONCE`` in a process of its own, the base and the snapshot warm; ``code``: a checkout
    whose ``shared`` and ``publisher`` to run instead of this one's (``--before``)."""
    shutil.rmtree(weights / "v2", ignore_errors=True)
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = f"{code / 'shared'}:{code / 'publisher'}"
    warm(snapshot)
    warm(weights / "v1")
    os.sync()
    time.sleep(0.5)
    command = [sys.executable, "-c", ONCE, str(snapshot), str(weights), "on" if delta else "off"]
    command.append(behind)
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode:
        raise SystemExit(f"publish failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def node_read(weights: Path, base: VersionInfo | None) -> tuple[float, str]:
    """A node's read of v2, holding v1 (``base``) or fresh, v2's pages dropped first: the
    seconds and how it read (``delta`` or ``full``)."""
    reader = VersionReader(weights, keep_base=base is not None)
    if base is not None:
        reader.rank_tensors(base, 0, 1)
    info = registered(weights, 2)
    drop_pages(weights / "v2", sync=True)
    seconds = timed(partial(reader.rank_tensors, info, 0, 1))
    return seconds, reader.stats.via


def publish(args: argparse.Namespace) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="bench-delta-", dir=args.dir))
    results = []
    try:
        first = write_snapshot(work / "s1", args.shape)
        weights = work / "weights"
        weights.mkdir()
        convert(first, weights, 1, ConvertOptions(delta=False))
        base = registered(weights, 1)
        data = sum(f.bytes for f in first.info.files)
        for percent in args.change_rates:
            second = moved_copy(work / "s1", work / "s2", percent)
            rows = []
            for round_ in range(args.rounds):
                row: dict = {"load": os.getloadavg()[0]}
                warm(second.path)
                os.sync()
                time.sleep(0.5)
                row["cp_fsync"] = raw_copy(second.path, weights / ".raw")
                shutil.rmtree(weights / ".raw")
                kinds = ["on", "off"] + (["before"] if args.before else [])
                turn = round_ % len(kinds)  # each kind in each place in turn (not one always
                for key in kinds[turn:] + kinds[:turn]:  # after cp + fsync or in the middle)
                    delta = key != "off"
                    code = args.before if key == "before" else None
                    got = publish_once(second.path, weights, delta, code, args.delta_behind)
                    row |= {f"{key}_{k}": v for k, v in got.items()}
                    row[f"{key}_node"], row[f"{key}_via"] = node_read(
                        weights, base if delta else None
                    )
                    if key == "on" and round_ == 0:
                        row["offline_delta"] = offline_delta_bytes(weights / "v2", weights / "v1")
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)  # fmt: skip
            shutil.rmtree(work / "s2")
            results.append(summary(args.shape, percent, data, rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def summary(shape: str, percent: float, data: int, rows: list[dict]) -> dict:
    """Medians over the rounds, and the median of each round's ratio to its cp + fsync."""
    on, off = ratio(rows, "on_seconds", "cp_fsync"), ratio(rows, "off_seconds", "cp_fsync")
    kept = [r["on_delta_bytes"] for r in rows if r["on_delta_bytes"]]
    reasons = sorted({r["on_no_delta"][:60] for r in rows if r["on_no_delta"]})
    fresh_on = statistics.median(r["on_seconds"] + r["on_node"] for r in rows)
    fresh_off = statistics.median(r["off_seconds"] + r["off_node"] for r in rows)
    print(
        f"{shape}, {percent:g}% of values moved (load {min(r['load'] for r in rows):.1f}-"
        f"{max(r['load'] for r in rows):.1f}): cp+fsync {med(rows, 'cp_fsync'):.2f} s\n"
        f"  defaults (delta on): {med(rows, 'on_seconds'):.2f} s, {spread(on)},"
        f" RSS {med(rows, 'on_rss_mb'):.0f} MB, delta kept in {len(kept)}/{len(rows)} rounds "
        f"({statistics.median(kept) / data if kept else 0:.2%} of the version) {reasons}\n"
        f"  --no-delta: {med(rows, 'off_seconds'):.2f} s, {spread(off)}, "
        f"RSS {med(rows, 'off_rss_mb'):.0f} MB\n"
        f"  delta if encoded whole: {rows[0]['offline_delta'] / data:.2%} of the version\n"
        f"  node holding v1: defaults {med(rows, 'on_node'):.2f} s "
        f"({sorted({r['on_via'] for r in rows})}), freshness {fresh_on:.2f} s; "
        f"fresh node, --no-delta: {med(rows, 'off_node'):.2f} s, freshness {fresh_off:.2f} s",
        flush=True,
    )
    if "before_seconds" in rows[0]:
        before = ratio(rows, "before_seconds", "cp_fsync")
        fresh = statistics.median(r["before_seconds"] + r["before_node"] for r in rows)
        print(
            f"  --before: {med(rows, 'before_seconds'):.2f} s, {spread(before)}, "
            f"RSS {med(rows, 'before_rss_mb'):.0f} MB; node "
            f"{med(rows, 'before_node'):.2f} s ({sorted({r['before_via'] for r in rows})}), "
            f"freshness {fresh:.2f} s",
            flush=True,
        )
    return {"shape": shape, "percent": percent, "bytes": data, "rounds": rows}


def node(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-delta-", dir=args.dir))
    try:
        first = write_snapshot(work / "s1", args.shape)
        second = changed_copy(work / "s1", work / "s2", args.changed)
        weights = work / "weights"
        weights.mkdir()
        convert(first, weights, 1, ConvertOptions(delta=False))
        base_info = registered(weights, 1)
        rows = []
        for _ in range(args.rounds):
            row: dict[str, float] = {}
            for kind in ("publish_cold", "publish_delta", "publish_full"):
                shutil.rmtree(weights / "v2", ignore_errors=True)
                if kind == "publish_cold":
                    drop_pages(weights / "v1", sync=True)
                os.sync()
                time.sleep(0.5)
                options = ConvertOptions(delta=kind != "publish_full")
                row[kind] = timed(partial(convert, second, weights, 2, options))
            shutil.rmtree(weights / "v2")
            published = convert(second, weights, 2, ConvertOptions(delta=True))
            info = registered(weights, 2)
            row["delta_ratio"] = published.manifest.delta.bytes / (
                published.manifest.total_bytes - published.manifest.delta.bytes
            )
            holder = VersionReader(weights, keep_base=True)
            holder.rank_tensors(base_info, 0, 1)
            drop_pages(weights / "v2", sync=True)
            row["node_delta"] = timed(partial(holder.rank_tensors, info, 0, 1))
            assert holder.stats.via == "delta", holder.stats.reason
            row["delta_read_bytes"] = holder.stats.bytes_read
            del holder
            fresh = VersionReader(weights)
            drop_pages(weights / "v2", sync=True)
            row["node_full"] = timed(partial(fresh.rank_tensors, info, 0, 1))
            row["full_read_bytes"] = fresh.stats.bytes_read
            rows.append(row)
            print(json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        publish = [r["publish_delta"] / r["publish_full"] for r in rows]
        cold = [r["publish_cold"] / r["publish_full"] for r in rows]
        update = [r["node_delta"] / r["node_full"] for r in rows]
        print(
            f"{args.shape}, {args.changed:.1%} of values changed: delta {med['delta_ratio']:.2%} "
            f"of the version\n"
            f"  publish without delta {med['publish_full']:.2f} s; with delta, warm base "
            f"{med['publish_delta']:.2f} s: {statistics.median(publish):.2f}x "
            f"({min(publish):.2f}..{max(publish):.2f}); cold base {med['publish_cold']:.2f} s: "
            f"{statistics.median(cold):.2f}x ({min(cold):.2f}..{max(cold):.2f})\n"
            f"  node update by delta {med['node_delta']:.2f} s ({med['delta_read_bytes'] / 1e6:.0f}"
            f" MB read), by full {med['node_full']:.2f} s ({med['full_read_bytes'] / 1e6:.0f} MB):"
            f" {statistics.median(update):.2f}x ({min(update):.2f}..{max(update):.2f})"
        )
        return {"shape": args.shape, "changed": args.changed, "rounds": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def chain(args: argparse.Namespace) -> dict:
    # This measures the node: the publisher here keeps every delta, even one whose encoding
    # falls behind its write on a loaded machine (``delta_behind`` wait).
    work = Path(tempfile.mkdtemp(prefix="bench-chain-", dir=args.dir))
    try:
        weights = work / "weights"
        weights.mkdir()
        convert(write_snapshot(work / "s1", args.shape), weights, 1, ConvertOptions(delta=False))
        newest = args.behind + 1
        for version in range(2, newest + 1):
            source, target = work / f"s{version - 1}", work / f"s{version}"
            snapshot = moved_copy(source, target, args.changed * 100, seed=version)
            options = ConvertOptions(delta=True, delta_behind="wait")
            published = convert(snapshot, weights, version, options)
            if published.no_delta:
                raise SystemExit(f"v{version} has no delta: {published.no_delta}")
            shutil.rmtree(source)
        infos = {v: registered(weights, v) for v in range(1, newest + 1)}
        links = [infos[v] for v in range(2, newest)]
        deltas = [Manifest.read(weights / f"v{v}").delta for v in range(2, newest + 1)]
        size = Manifest.read(weights / f"v{newest}").total_bytes
        rows = []
        for at in range(args.rounds):
            row: dict[str, float] = {}
            holder = VersionReader(weights, keep_base=True, max_delta_chain=args.behind)
            holder.rank_tensors(infos[1], 0, 1)
            for version in range(2, newest + 1):
                drop_pages(weights / f"v{version}", sync=True)
            row["node_chain"] = timed(partial(holder.rank_tensors, infos[newest], 0, 1, 1, links))
            assert holder.stats.via == "chain", holder.stats.reason
            row["chain_read_bytes"] = holder.stats.bytes_read
            fresh = VersionReader(weights)
            drop_pages(weights / f"v{newest}", sync=True)
            row["node_full"] = timed(partial(fresh.rank_tensors, infos[newest], 0, 1))
            row["full_read_bytes"] = fresh.stats.bytes_read
            if at == 0:  # bitwise the same version
                chained = holder.rank_tensors(infos[newest], 0, 1)
                whole = fresh.rank_tensors(infos[newest], 0, 1)
                assert all(torch.equal(chained[k], whole[k]) for k in whole)
            del holder, fresh
            rows.append(row)
            print(json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        ratios = [r["node_chain"] / r["node_full"] for r in rows]
        sizes = ", ".join(f"{d.bytes / size:.2%}" for d in deltas if d is not None)
        print(
            f"{args.shape}, {args.changed:.1%} of values moved per version, deltas {sizes} of "
            f"the version\n  node {args.behind} versions behind: by chain {med['node_chain']:.2f}"
            f" s ({med['chain_read_bytes'] / 1e6:.0f} MB read), by full {med['node_full']:.2f} s"
            f" ({med['full_read_bytes'] / 1e6:.0f} MB): {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}..{max(ratios):.2f})"
        )
        return {"shape": args.shape, "changed": args.changed, "behind": args.behind, "rounds": rows}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("train", "node", "publish", "chain"))
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6B")
    parser.add_argument("--changed", type=float, default=0.01, help="share of values changed")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--behind", type=int, default=3, help="chain: versions behind")
    parser.add_argument(
        "--change-rates",
        type=float,
        nargs="+",
        default=[3, 15, 100],
        help="publish: percent of values moved (100: all redrawn)",
    )
    parser.add_argument("--dir", default=None, help="where to write (default: $TMPDIR)")
    parser.add_argument(
        "--delta-behind",
        default="auto",
        choices=("auto", "drop", "wait"),
        help="publish: the publisher's delta_behind rule with deltas on (auto: as one node)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="publish: also publish with deltas on by the code of this checkout (git archive "
        "of an earlier commit), alternating in the same rounds",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    parts = {"train": train, "node": node, "publish": publish, "chain": chain}
    result = parts[args.part](args)
    save_json(args.json, result)


if __name__ == "__main__":
    main()
