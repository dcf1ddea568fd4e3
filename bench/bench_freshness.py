"""End-to-end freshness: from a snapshot's rename to every node holding its weights on device.

A real publisher daemon and ``--nodes`` node processes (each a ``WeightsClient``: wait for a
newer version, lease it, read and verify tp rank 0's tensors, copy them to ``--device``,
synchronize, report ``{wc}:nodes``) run against a private redis-server. Each round renames a
new snapshot into the checkpoint directory (linked from a template, pages warm, as one the
trainer has just written) and waits until every node reports that version. Printed: medians
over the rounds of the time to the ``published`` event and to the last node's report, with
the spread. ``--device cpu`` is the dry mode for machines without a GPU.

    .venv/bin/python bench/bench_freshness.py --shape 0.6B --nodes 2 --device cuda
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
from pathlib import Path

import redis

from weightcast.contract.keys import Keys
from weightcast.contract.snapshots import FORMAT_DCP_SAFETENSORS, SnapshotInfo
from weightcast.local.redis_server import RedisServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_publisher import REPO, SHAPES, publisher_env, settle, write_template


def node(args: argparse.Namespace) -> None:
    """One inference node: load every new version onto the device, then report it."""
    import torch

    from weightcast.client.weights import WeightsClient

    client = WeightsClient(
        args.redis_url, args.weights_dir, namespace=args.namespace, node_id=args.node_id
    )
    version = 0
    while True:
        newer = client.wait_for_newer(version, timeout=600)
        if newer is None:
            return
        with client.lease(newer) as info:
            tensors = {
                name: tensor.to(args.device, non_blocking=True)
                for name, tensor in client.rank_tensors(info, 0, 1).items()
            }
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
        client.report_loaded(newer)
        del tensors
        version = newer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="0.6B", choices=SHAPES)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--node", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    parser.add_argument("--node-id", help=argparse.SUPPRESS)
    parser.add_argument("--weights-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node:
        node(args)
        return
    root = Path(tempfile.mkdtemp(prefix="wc-fresh-", dir=args.dir))
    checkpoints, weights, template = root / "checkpoints", root / "weights", root / "template"
    checkpoints.mkdir()
    weights.mkdir()
    nbytes, files = write_template(template, SHAPES[args.shape], FORMAT_DCP_SAFETENSORS)
    keys = Keys(f"fresh-{uuid.uuid4().hex[:6]}")
    processes: list[subprocess.Popen] = []
    published, loaded = [], []
    with RedisServer(root / "redis") as server:
        client = redis.Redis.from_url(server.url)
        env = publisher_env(server.url, keys, checkpoints, weights)
        log = open(root / "daemons.log", "wb")  # noqa: SIM115 (closed below)
        daemon = [sys.executable, "-m", "weightcast", "publisher", "--keep", "2"]
        processes.append(subprocess.Popen(daemon, env=env, cwd=REPO, stdout=log, stderr=log))
        for i in range(args.nodes):
            command = [sys.executable, __file__, "--node", "--redis-url", server.url]
            command += ["--namespace", keys.namespace, "--node-id", f"node-{i}"]
            command += ["--weights-dir", str(weights), "--device", args.device]
            processes.append(subprocess.Popen(command, cwd=REPO, stdout=log, stderr=log))
        try:
            while not client.get(keys.publisher_leader):
                assert processes[0].poll() is None, (root / "daemons.log").read_text()
                time.sleep(0.1)
            for step in range(1, args.rounds + 1):
                tmp = checkpoints / f".tmp-step-{step}"
                shutil.copytree(template, tmp, copy_function=os.link)
                info = SnapshotInfo(
                    uuid.uuid4().hex,
                    "fresh",
                    step,
                    time.time(),
                    "bfloat16",
                    args.shape,
                    FORMAT_DCP_SAFETENSORS,
                    files,
                )
                info.write(tmp)
                settle()
                start = time.time()
                os.rename(tmp, checkpoints / f"step-{step}")
                while not client.get(keys.latest) or int(client.get(keys.latest)) < step:
                    assert all(p.poll() is None for p in processes), (
                        root / "daemons.log"
                    ).read_text()
                    time.sleep(0.01)
                published.append(float(client.hget(keys.version(step), "created_at")) - start)
                while True:
                    reports = [json.loads(v) for v in client.hvals(keys.nodes)]
                    done = [r["at"] for r in reports if r["version"] >= step]
                    if len(done) == args.nodes:
                        break
                    assert all(p.poll() is None for p in processes), (
                        root / "daemons.log"
                    ).read_text()
                    time.sleep(0.01)
                loaded.append(max(done) - start)
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=60)
            log.close()
    shutil.rmtree(root, ignore_errors=True)
    result = {
        "shape": args.shape,
        "bytes": nbytes,
        "nodes": args.nodes,
        "device": args.device,
        "rounds": args.rounds,
        "published_s": statistics.median(published),
        "all_nodes_loaded_s": statistics.median(loaded),
        "loaded_min_s": min(loaded),
        "loaded_max_s": max(loaded),
    }
    print(
        f"{args.shape} ({nbytes / 1e9:.2f} GB) -> {args.nodes} nodes on {args.device}: "
        f"published {result['published_s']:.2f} s, "
        f"on every node {result['all_nodes_loaded_s']:.2f} s "
        f"({result['loaded_min_s']:.2f}..{result['loaded_max_s']:.2f}), medians of {args.rounds}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
