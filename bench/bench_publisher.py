"""Publish time and peak RSS of the real publisher daemon against cp + fsync of the same bytes.

For each model shape a random bf16 snapshot is written once as a template (``dcp-safetensors/1``
as the trainer writes it, or ``--format dcp-torchsave``). Each round then links the template
into ``.tmp-step-N/`` (its pages are warm, as a snapshot the trainer has just written), then
(1) copies the template's data files into the weights filesystem with fsync: the baseline,
the time any publish must at least spend moving those bytes; and (2) renames
``.tmp-step-N/`` to ``step-N/`` and times, from just before the rename, until the running
publisher's ``published`` event arrives (watch, read headers, plan, copy, digest, check
floats, fsync, rename, register). Before each timing the filesystem is synced and left idle
for a second. Printed per shape: medians over the rounds, the median of the per-round ratios
publish / baseline with its spread (min..max), and the daemon's peak RSS (VmHWM, its whole
life, imports included). ``--json`` writes the same as JSON. ``--stages`` also times, each
round on the same bytes, each per-byte stage of the writer alone (copy from the page cache,
block digests, NaN scan) and its read + digest + scan pipeline without the write: the floor
under the publish on this machine.

    .venv/bin/python -m bench publisher                          # tiny, 0.6B, 1.7B
    .venv/bin/python -m bench publisher --shapes 0.6B --rounds 7 --format dcp-torchsave
    .venv/bin/python -m bench publisher --shapes 0.6B --stages --no-delta
    .venv/bin/python -m bench publisher --shapes 30B-A3B-2L --tp 4 --expert-parallel
    .venv/bin/python -m bench publisher --shapes 0.6B --quantize fp8   # FP8 versions
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import redis
import torch

from common import (
    REPO,
    data_files,
    machine_line,
    next_event,
    peak_rss_mb,
    raw_copy,
    save_json,
    settle,
    weightcast_env,
)
from weightcast.contract.keys import Keys
from weightcast.contract.model_shape import SHAPES, ModelShape, hf_tensor_shapes
from weightcast.contract.snapshot_format import (
    FORMAT_DCP_SAFETENSORS,
    FORMAT_DCP_TORCH_SAVE,
    INFO_NAME,
    SHARDING_INFO_KEY,
    SnapshotFile,
    SnapshotInfo,
    data_file_name,
)
from weightcast.contract.tensorfile import encode_header, file_order
from weightcast.local.redis_server import RedisServer
from weightcast.runtime.durable import write_json
from weightcast_trainer.dcp_safetensors import DCP_VERSION


def random_tensors(shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """Random bf16 tensors under the shape's HF names, one at a time: random bits with the
    exponent's top bit cleared (finite, below 2 in magnitude), never repeating (a model's bytes
    do not repeat either). Drawn four times faster than normal values, whose 8 billion draws
    for the 8B shape take minutes."""
    rng = np.random.default_rng(0)
    for name, size in hf_tensor_shapes(shape).items():
        bits = rng.integers(0, 1 << 16, size=math.prod(size), dtype=np.uint16)
        bits &= 0xBFFF
        yield name, torch.from_numpy(bits).view(torch.bfloat16).reshape(size)


def random_state(shape: ModelShape) -> dict[str, torch.Tensor]:
    """:func:`random_tensors`, all of them."""
    return dict(random_tensors(shape))


def write_streamed(path: Path, shape: ModelShape) -> int:
    """:func:`random_tensors` as one ``dcp-safetensors/1`` file, the bytes the trainer's
    ``write_file`` would write, tensor by tensor as each is drawn: the 8B shape's 16 GB are
    never in memory at once. Its size."""
    sizes = hf_tensor_shapes(shape)
    offsets = {n: {"saved_offsets": [0] * len(s)} for n, s in sizes.items()}
    metadata = {
        SHARDING_INFO_KEY: json.dumps(offsets),
        "DCP_VERSION": DCP_VERSION,
        "format": "pt",
    }
    order = [n for n, _ in file_order((n, "BF16") for n in sizes)]
    header = encode_header([(n, "BF16", sizes[n]) for n in order], metadata)
    starts, at = {}, len(header)
    for name in order:
        starts[name], at = at, at + 2 * math.prod(sizes[name])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        for name, tensor in random_tensors(shape):
            view, done = memoryview(tensor.view(torch.uint8).reshape(-1).numpy()), 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], starts[name] + done)
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def write_template(
    path: Path, shape: ModelShape, format: str
) -> tuple[int, tuple[SnapshotFile, ...]]:
    """A random bf16 snapshot in HF names; the bytes of its data files and their listing."""
    path.mkdir(parents=True)
    files: tuple[SnapshotFile, ...] = ()
    if format == FORMAT_DCP_SAFETENSORS:
        name = data_file_name(0)
        files = (SnapshotFile(name, write_streamed(path / name, shape)),)
    else:
        import torch.distributed.checkpoint as dcp

        state = random_state(shape)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    (path / "config.json").write_text(json.dumps(shape.to_hf_config()))
    return sum(f.stat().st_size for f in data_files(path)), files


def stage_seconds(path: Path, digest: str) -> dict[str, float]:
    """Each per-byte stage of the writer alone, in one thread, on ``path`` (pages warm), one
    ring buffer at a time as the writer does: the copy from the page cache into the buffer,
    the block digests, the NaN scan of its float tensors; then the writer's own read + digest
    + scan pipeline (its threads, its ring, no write)."""
    from weightcast.contract.manifest import BLOCK_BYTES, new_hasher
    from weightcast.contract.tensorfile import NON_FINITE, read_header
    from weightcast_publisher.safetensors_writer import (
        _CHECK_BYTES,
        BUFFER_BYTES,
        _non_finite,
        digest_file,
    )

    seconds = dict.fromkeys(("copy_s", "hash_s", "scan_s"), 0.0)
    buffer, scratch = mmap.mmap(-1, BUFFER_BYTES), np.empty(_CHECK_BYTES, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        spans = [s for s in read_header(fd, str(path)).tensors if s.dtype in NON_FINITE]
        size = os.fstat(fd).st_size
        for offset in range(0, size, BUFFER_BYTES):
            t0 = time.perf_counter()
            n = os.preadv(fd, [buffer], offset)
            t1 = time.perf_counter()
            with memoryview(buffer) as view:
                for at in range(0, n, BLOCK_BYTES):
                    hasher = new_hasher(digest)
                    hasher.update(view[at : min(n, at + BLOCK_BYTES)])
                    hasher.hexdigest()
            t2 = time.perf_counter()
            for span in spans:
                lo, hi = max(span.start, offset), min(span.stop, offset + n)
                if lo < hi:
                    assert not _non_finite(buffer, lo - offset, hi - lo, span.dtype, scratch)
            t3 = time.perf_counter()
            seconds["copy_s"] += t1 - t0
            seconds["hash_s"] += t2 - t1
            seconds["scan_s"] += t3 - t2
    finally:
        os.close(fd)
        buffer.close()
    start = time.perf_counter()
    digest_file(path, spans, digest, path.name)
    return seconds | {"pipeline_s": time.perf_counter() - start}


def bench_shape(name: str, rounds: int, root: Path, server: RedisServer, args) -> dict:
    work = root / name
    checkpoints, weights, template = work / "checkpoints", work / "weights", work / "template"
    for d in (checkpoints, weights):
        d.mkdir(parents=True)
    nbytes, files = write_template(template, SHAPES[name], args.format)
    keys = Keys(f"bench-{uuid.uuid4().hex[:6]}")
    client = redis.Redis.from_url(server.url)
    events = client.pubsub()
    events.subscribe(keys.events)
    env = weightcast_env(server.url, keys.namespace, checkpoints, weights)
    log = open(work / "publisher.log", "wb")  # noqa: SIM115 (closed below)
    command = [sys.executable, "-m", "weightcast", "publisher", "--tp", str(args.tp)]
    command += ["--reader", args.reader, "--rescan-seconds", "30", "--layout", args.layout]
    command += ["--digest", args.digest, "--keep", "1", "--delta" if args.delta else "--no-delta"]
    command += ["--expert-parallel"] if args.expert_parallel else []
    command += ["--quantize", args.quantize]
    daemon = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not client.get(keys.publisher_leader):
            assert daemon.poll() is None, (work / "publisher.log").read_text()
            assert time.monotonic() < deadline, "publisher did not start"
            time.sleep(0.1)
        raw, publish, stages = [], [], []
        for step in range(1, rounds + 1):
            tmp = checkpoints / f".tmp-step-{step}"
            shutil.copytree(template, tmp, copy_function=os.link)  # warm pages, no space
            info = SnapshotInfo(
                uuid.uuid4().hex, "bench", step, time.time(), "bfloat16", name, args.format, files
            )
            write_json(tmp / INFO_NAME, info.to_json())
            settle()
            raw.append(raw_copy(template, weights / f".raw-{step}"))
            shutil.rmtree(weights / f".raw-{step}")
            if args.stages:
                stages += [stage_seconds(f, args.digest) for f in data_files(template)]
            settle()
            start = time.perf_counter()
            os.rename(tmp, checkpoints / f"step-{step}")
            event = next_event(events, 600, (work / "publisher.log").read_text)
            assert event["event"] == "published", event
            publish.append(time.perf_counter() - start)
            version_bytes = weights_bytes(weights)
            events.get_message(timeout=0.5)  # an eviction event, if any
            shutil.rmtree(checkpoints / f"step-{step}", ignore_errors=True)  # disk for 8B
        rss = peak_rss_mb(daemon.pid)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        log.close()
        shutil.rmtree(work, ignore_errors=True)
    ratios = [p / r for p, r in zip(publish, raw, strict=True)]
    per_stage = {k: statistics.median(st[k] for st in stages) for k in stages[0]} if stages else {}
    return per_stage | {
        "shape": name,
        "bytes": nbytes,
        "rounds": rounds,
        "cp_fsync_s": statistics.median(raw),
        "publish_s": statistics.median(publish),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "publish_GBps": nbytes / statistics.median(publish) / 1e9,
        "peak_rss_mb": rss,
        "version_bytes": version_bytes,
    }


def weights_bytes(weights: Path) -> int:
    """The weights files' bytes of the newest version (its deltas and JSON left out)."""
    newest = max(
        (p for p in weights.iterdir() if p.name.startswith("v")), key=lambda p: int(p.name[1:])
    )
    return sum(
        f.stat().st_size for f in newest.rglob("*") if f.suffix in (".vllm-fused", ".safetensors")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "0.6B", "1.7B"], choices=SHAPES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument(
        "--expert-parallel", action="store_true", help="MoE shapes: whole experts per rank"
    )
    parser.add_argument("--layout", default="vllm-fused", choices=["vllm-fused", "hf", "both"])
    parser.add_argument("--reader", default="auto", choices=["auto", "dcp-load"])
    parser.add_argument("--quantize", default="none", choices=["none", "fp8"])
    parser.add_argument("--digest", default="xxh3-128", choices=["xxh3-128", "blake3"])
    parser.add_argument(
        "--format",
        default=FORMAT_DCP_SAFETENSORS,
        choices=[FORMAT_DCP_SAFETENSORS, FORMAT_DCP_TORCH_SAVE],
    )
    parser.add_argument(
        "--delta",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the publisher's --delta (on by default; each round's base is the last round)",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="also time each per-byte stage of the writer alone on the same data, per round",
    )
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: /tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wc-bench-", dir=args.dir))
    machine = machine_line()
    settings = f"format={args.format} reader={args.reader} layout={args.layout} tp={args.tp}"
    settings += " expert-parallel" if args.expert_parallel else ""
    settings += f" delta={'on' if args.delta else 'off'} quantize={args.quantize}"
    print(f"{machine}; {settings} digest={args.digest} rounds={args.rounds} dir={root}")
    print(
        f"{'shape':>6} {'GB':>6} {'cp+fsync s':>10} {'publish s':>10} {'ratio':>6} "
        f"{'spread':>11} {'GB/s':>5} {'RSS MB':>7} {'version GB':>10}"
    )
    results = []
    with RedisServer(root / "redis") as server:
        for name in args.shapes:
            r = bench_shape(name, args.rounds, root, server, args)
            results.append(r)
            print(
                f"{name:>6} {r['bytes'] / 1e9:6.2f} {r['cp_fsync_s']:10.3f} {r['publish_s']:10.3f} "
                f"{r['ratio']:6.2f} {r['ratio_min']:5.2f}..{r['ratio_max']:<5.2f} "
                f"{r['publish_GBps']:5.2f} {r['peak_rss_mb']:7.0f} "
                f"{r['version_bytes'] / 1e9:10.3f}",
                flush=True,
            )
            if args.stages:
                print(
                    f"{'':>6} stages alone (median s): copy {r['copy_s']:.3f} "
                    f"xxh3/digest {r['hash_s']:.3f} NaN scan {r['scan_s']:.3f} "
                    f"sum {r['copy_s'] + r['hash_s'] + r['scan_s']:.3f}; "
                    f"writer pipeline without write {r['pipeline_s']:.3f}",
                    flush=True,
                )
    shutil.rmtree(root, ignore_errors=True)
    given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    save_json(args.json, {"machine": machine, "settings": given, "results": results})


if __name__ == "__main__":
    main()
