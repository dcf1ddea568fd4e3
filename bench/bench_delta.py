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

    .venv/bin/python bench/bench_delta.py train --lrs 1e-6 1e-5 --steps 8
    .venv/bin/python bench/bench_delta.py node --shape 0.6B --rounds 5
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
from collections.abc import Callable
from functools import partial
from pathlib import Path

import redis
import torch

from bench_node import registered, write_snapshot
from weightcast.client.producer import BatchProducer
from weightcast.client.reader import VersionReader
from weightcast.contract.keys import Keys
from weightcast.contract.model_shape import SHAPES
from weightcast.contract.snapshot_format import SnapshotInfo
from weightcast.local.produce import synthetic_batch
from weightcast.local.redis_server import RedisServer
from weightcast_publisher.converter import ConvertOptions, convert
from weightcast_publisher.snapshot_scan import Snapshot
from weightcast_trainer.model import flavor_args

REPO = Path(__file__).resolve().parent.parent


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
    env = {
        **os.environ,
        "WEIGHTCAST_REDIS_URL": redis_url,
        "WEIGHTCAST_NAMESPACE": namespace,
        "WEIGHTCAST_CHECKPOINT_DIR": str(run_dir / "checkpoints"),
        "WEIGHTCAST_WEIGHTS_DIR": str(run_dir / "weights"),
    }
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
    shutil.copytree(source, target)
    info = SnapshotInfo.read(target)
    for entry in info.files:
        path = target / entry.name
        data = bytearray(path.read_bytes())
        header = 8 + int.from_bytes(data[:8], "little")
        nudge(torch.frombuffer(memoryview(data)[header:], dtype=torch.int16), fraction)
        path.write_bytes(data)
    return Snapshot(target, info)


def drop_cache(directory: Path) -> None:
    os.sync()
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


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
                    drop_cache(weights / "v1")
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
            drop_cache(weights / "v2")
            row["node_delta"] = timed(partial(holder.rank_tensors, info, 0, 1))
            assert holder.stats.via == "delta", holder.stats.reason
            row["delta_read_bytes"] = holder.stats.bytes_read
            del holder
            fresh = VersionReader(weights)
            drop_cache(weights / "v2")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("train", "node"))
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6B")
    parser.add_argument("--changed", type=float, default=0.01, help="share of values changed")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: $TMPDIR)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    result = train(args) if args.part == "train" else node(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
