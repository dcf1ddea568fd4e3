"""End-to-end freshness: trainer snapshot start -> version registered -> a tp-T node loaded.

For each tp T, a private redis-server, the real publisher daemon (``weightcast publisher
--tp T``, a separate process) and one inference node: T worker processes, one per
tensor-parallel rank as vLLM runs them, each doing what weightcast's vLLM backend does
before it touches the model (:meth:`weightcast.client.vllm.staging.RankReader.stage`: lease the
version, verify and read its rank's part through ``WeightsClient.rank_tensors``, the node's
workers sharing one verification record), then copying the part to ``--device``
(synchronized) and reporting the version in ``{wc}:nodes``. Each round, in this process, the
trainer's own :class:`~weightcast_trainer.snapshot_writer.SnapshotWriter` takes a snapshot of a
random bf16 Qwen3-shaped model (copy to host buffers, background DCP write in
``dcp-safetensors/1``, fsync, rename), as the training loop does, and the clock runs from
``SnapshotWriter.start`` to the last worker's report. Stages: ``snapshot`` (start -> the
rename), ``publish`` (rename -> registered: the registry's ``created_at``), ``node``
(registered -> the last rank loaded).

Two modes per tp, one after the other, each with its own publisher and node: ``full`` (the
publisher run with ``--no-delta``, workers that keep no base: every version read whole) and
``delta`` (the publisher writing deltas, each worker keeping its rank's base in a
``VersionReader(keep_base=True)`` across versions, as the vLLM backend does, so it rebuilds
the next version from the delta). Before each snapshot ``--changed`` of the model's bf16
values move to a neighbouring value (``bench_delta.nudge``: what a small optimizer step does),
in both modes. Each round prints how the ranks got the version (``via``) and what they read.

The floor, measured in the same round just before: one raw write of the model's bytes from
memory (one file, fsync) and one raw read of them, cold (``posix_fadvise(DONTNEED)`` after
the fsync), into fresh memory. A version goes through the disk twice more than the floor
(the trainer's snapshot, then the publisher's copy) and is read once.

Why one node per tp and not four nodes on one version: a ``vllm-fused`` version is cut for
one tp (its fused qkv and gate_up rows are ordered per rank), and a vLLM engine at another
tp refuses it; nodes at several tps take one publisher each (or the ``hf`` layout, where
every worker reads every tensor whole). Each tp's rounds run with only that tp's processes
up. The first round of each tp (imports, first allocation of the staging buffers) is a
warm-up and is not counted. Medians over the rounds, the spread of the per-round ratios.

    .venv/bin/python -m bench freshness                           # 0.6B, tp 1 2 4 8
    .venv/bin/python -m bench freshness --modes delta --changed 0.05
    .venv/bin/python -m bench freshness --shape 0.6B --tp 1 8 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import redis
import torch
from torch import nn

from bench_delta import nudge
from bench_publisher import random_state
from common import REPO, cold_read, raw_write, save_json, settle, weightcast_env
from weightcast.contract.keys import Keys
from weightcast.contract.model_shape import SHAPES
from weightcast.local.redis_server import RedisServer

MODES = ("full", "delta")
STAGES = ("snapshot", "publish", "node", "total", "floor_write", "floor_read", "floor")


def worker(args: argparse.Namespace) -> None:
    """One vLLM-like worker: rank ``args.rank`` of a tp ``args.node_tp`` node."""
    from weightcast.client.vllm.protocol import ResolvedLocation
    from weightcast.client.vllm.staging import RankReader
    from weightcast.client.weights import WeightsClient
    from weightcast.runtime.settings import load_config

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    tp = args.node_tp
    node = f"node-tp{tp}"
    source = ResolvedLocation(
        args.redis_url, args.namespace, Path(args.weights_dir), node, Path(args.verified_dir)
    )
    shape = SHAPES[args.shape]
    reporter = f"{node}-rank{args.rank}"
    client = WeightsClient(
        args.redis_url, args.weights_dir, namespace=args.namespace, node_id=reporter
    )
    # The rank's reader, kept across versions as the vLLM backend keeps it (with its base for
    # a delta node).
    reader = RankReader(source, args.rank, args.keep_base, load_config(env={}))
    version = 0
    while (newer := client.wait_for_newer(version, timeout=3600)) is not None:
        staged = reader.stage(newer, tp, shape)
        on_device = [p.tensor.to(args.device, non_blocking=True) for p in staged.parts]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        client.report_loaded(newer, via=staged.via, read_bytes=staged.read_bytes)
        del staged, on_device
        version = newer


class Weights(nn.Module):
    """A model whose state dict is already HF-named (the writer's ``to_hf`` is the identity)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.hf = state

    def state_dict(self, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self.hf


def random_model(shape: str) -> Weights:
    return Weights(random_state(SHAPES[shape]))


def model_bytes(model: Weights) -> Iterator[memoryview]:
    """Every tensor's bytes, in order (what the floor writes)."""
    for tensor in model.hf.values():
        yield memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def bench_tp(tp: int, mode: str, model: Weights, args: argparse.Namespace, root: Path) -> dict:
    """``args.rounds`` rounds (after a warm-up) of one tp-``tp`` pipeline in ``mode``."""
    import weightcast_trainer.snapshot_writer as snapshot_module
    from weightcast_trainer.snapshot_writer import SnapshotWriter

    work = root / f"tp{tp}-{mode}"
    checkpoints, weights, record = work / "checkpoints", work / "weights", work / "verified"
    for directory in (checkpoints, weights, record):
        directory.mkdir(parents=True)
    keys = Keys(f"fresh-{uuid.uuid4().hex[:6]}")
    renamed: list[float] = []
    publish_dir = snapshot_module.publish_dir

    def timed_publish_dir(tmp: Path, final: Path) -> None:
        publish_dir(tmp, final)
        renamed.append(time.time())

    snapshot_module.publish_dir = timed_publish_dir
    writer = SnapshotWriter(
        checkpoints, lambda s: s, SHAPES[args.shape].to_hf_config(), "bench", "run"
    )
    processes: list[subprocess.Popen] = []
    log = open(work / "processes.log", "wb")  # noqa: SIM115 (closed below)
    rows: list[dict[str, float]] = []
    with RedisServer(work / "redis") as server:
        client = redis.Redis.from_url(server.url)
        env = weightcast_env(server.url, keys.namespace, checkpoints, weights)
        daemon = [sys.executable, "-m", "weightcast", "publisher", "--tp", str(tp), "--keep", "1"]
        daemon.append("--delta" if mode == "delta" else "--no-delta")
        processes.append(subprocess.Popen(daemon, env=env, cwd=REPO, stdout=log, stderr=log))
        for rank in range(tp):
            command = [sys.executable, __file__, "--worker", "--rank", str(rank)]
            command += ["--node-tp", str(tp)]
            command += ["--redis-url", server.url, "--namespace", keys.namespace]
            command += ["--weights-dir", str(weights), "--verified-dir", str(record)]
            command += ["--shape", args.shape, "--device", args.device]
            command += ["--keep-base"] if mode == "delta" else []
            processes.append(subprocess.Popen(command, cwd=REPO, stdout=log, stderr=log))

        def alive() -> None:
            if any(p.poll() is not None for p in processes):
                log.flush()
                raise RuntimeError((work / "processes.log").read_text()[-4000:])

        try:
            for step in range(1, args.rounds + 2):  # the first round is a warm-up
                floor_file = work / "floor"
                floor_write = raw_write(floor_file, model_bytes(model), os.O_EXCL)
                floor_read = cold_read(floor_file)
                floor_file.unlink()
                settle()
                previous = int(client.get(keys.latest) or 0)
                for tensor in model.hf.values():
                    nudge(tensor.view(torch.int16).view(-1), args.changed)
                start = time.time()
                writer.start(model, step)
                while int(client.get(keys.latest) or 0) <= previous:
                    alive()
                    time.sleep(0.005)
                writer.wait()
                version = int(client.get(keys.latest))
                registered = float(client.hget(keys.version(version), "created_at"))
                while True:
                    reports = [json.loads(v) for v in client.hvals(keys.nodes)]
                    done = [r for r in reports if r["version"] >= version]
                    if len(done) == tp:
                        break
                    alive()
                    time.sleep(0.005)
                loaded = max(r["at"] for r in done)
                via = sorted({r.get("via", "?") for r in done})
                row = {
                    "snapshot": renamed[-1] - start,
                    "publish": registered - renamed[-1],
                    "node": loaded - registered,
                    "total": loaded - start,
                    "floor_write": floor_write,
                    "floor_read": floor_read,
                    "floor": floor_write + floor_read,
                    "read_mb": sum(r.get("read_bytes", 0) for r in done) / 1e6,
                    "load": os.getloadavg()[0],
                }
                if step > 1:
                    rows.append(row)
                shutil.rmtree(checkpoints / f"step-{step - 1}", ignore_errors=True)
                print(
                    f"tp {tp} {mode} round {step - 1}{' (warm-up)' if step == 1 else ''}: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in row.items())
                    + f", via {'+'.join(via)}",
                    flush=True,
                )
        finally:
            snapshot_module.publish_dir = publish_dir
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=60)
            log.close()
    shutil.rmtree(work, ignore_errors=True)
    ratios = [r["total"] / r["floor"] for r in rows]
    return {
        "tp": tp,
        "mode": mode,
        "read_mb": statistics.median(r["read_mb"] for r in rows),
        **{stage: statistics.median(r[stage] for r in rows) for stage in STAGES},
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "load": [min(r["load"] for r in rows), max(r["load"] for r in rows)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="0.6B", choices=SHAPES)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--changed", type=float, default=0.01, help="share of values changed")
    parser.add_argument("--device", default="cpu", help="where the nodes put the weights")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: /tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--node-tp", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    parser.add_argument("--weights-dir", help=argparse.SUPPRESS)
    parser.add_argument("--verified-dir", help=argparse.SUPPRESS)
    parser.add_argument("--keep-base", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp.save
    root = Path(tempfile.mkdtemp(prefix="wc-fresh-", dir=args.dir))
    model = random_model(args.shape)
    nbytes = sum(t.nbytes for t in model.hf.values())
    machine = f"{platform.node()}, {os.cpu_count()} CPUs"
    print(
        f"{machine}; {args.shape} ({nbytes / 1e9:.2f} GB), nodes on {args.device}, "
        f"{args.changed:.1%} of values changed per version",
        flush=True,
    )
    results = []
    try:
        for tp in args.tp:
            for mode in args.modes:
                results.append(bench_tp(tp, mode, model, args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{'tp':>3} {'mode':>5} {'read MB':>7} {'snapshot':>8} {'publish':>8} {'node':>6} "
        f"{'total':>6} {'write':>6} {'read':>6} {'floor':>6} {'total/floor':>17} {'load':>9}"
    )
    for r in results:
        print(
            f"{r['tp']:>3} {r['mode']:>5} {r['read_mb']:>7.0f} {r['snapshot']:>8.2f} "
            f"{r['publish']:>8.2f} {r['node']:>6.2f} {r['total']:>6.2f} "
            f"{r['floor_write']:>6.2f} {r['floor_read']:>6.2f} {r['floor']:>6.2f} "
            f"{r['ratio']:>6.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) "
            f"{r['load'][0]:>4.1f}-{r['load'][1]:.1f}"
        )
    report = {
        "machine": machine,
        "shape": args.shape,
        "bytes": nbytes,
        "device": args.device,
        "rounds": args.rounds,
        "changed": args.changed,
        "results": results,
    }
    save_json(args.json, report)


if __name__ == "__main__":
    main()
