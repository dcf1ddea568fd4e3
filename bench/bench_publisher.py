"""Publish time and peak RSS of the real publisher daemon against a raw copy with fsync.

For each model shape a random bf16 DCP snapshot is written once as a template. Each run then
copies the template to ``.tmp-step-N/``, then (1) copies the template's data files into the
weights filesystem with fsync: the baseline, the time any publish must at least spend moving
those bytes; and (2) renames ``.tmp-step-N/`` to ``step-N/`` and times, from just before the
rename, until the running publisher's ``published`` event arrives (watch, convert, hash,
fsync, rename, register). A second baseline copies with ``dd oflag=direct``, which like
the publisher's writer bypasses the page cache. Before each timing the filesystem is synced
and left idle for a second, so earlier deletes and writeback do not land in it. Medians over
the runs, the ratios, and the publisher's peak RSS (VmHWM, its whole life, torch import
included) are printed.

    .venv/bin/python bench/bench_publisher.py                # tiny, 0.6B, 1.7B
    .venv/bin/python bench/bench_publisher.py --shapes 0.6B --runs 7 --reader dcp-load
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
import torch
import torch.distributed.checkpoint as dcp

from weightcast.contract.durable import fsync_path
from weightcast.contract.keys import Keys
from weightcast.contract.snapshots import SnapshotInfo
from weightcast.local.redis_server import RedisServer

REPO = Path(__file__).resolve().parent.parent

# Real Qwen3 configurations (tiny: weightcast's own test model).
SHAPES = {
    "tiny": dict(layers=2, hidden=128, inter=384, heads=4, kv=2, head_dim=64, vocab=2048),
    "0.6B": dict(layers=28, hidden=1024, inter=3072, heads=16, kv=8, head_dim=128, vocab=151936),
    "1.7B": dict(layers=28, hidden=2048, inter=6144, heads=16, kv=8, head_dim=128, vocab=151936),
}


def hf_config(s: dict) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "num_hidden_layers": s["layers"],
        "hidden_size": s["hidden"],
        "intermediate_size": s["inter"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv"],
        "head_dim": s["head_dim"],
        "vocab_size": s["vocab"],
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }


def write_template(path: Path, s: dict) -> int:
    """A random bf16 snapshot in HF names; returns the bytes of its data files."""
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
    return sum(f.stat().st_size for f in path.glob("*.distcp"))


def settle() -> None:
    """Flush and wait, so that earlier deletes (discards) and writeback do not land in a timing."""
    os.sync()
    time.sleep(1.0)


def raw_copy(template: Path, target: Path) -> float:
    """Copy the template's data files with fsync: the baseline (the caller removes ``target``)."""
    start = time.perf_counter()
    target.mkdir()
    for src in sorted(template.glob("*.distcp")):
        dst = target / src.name
        shutil.copyfile(src, dst)
        fsync_path(dst)
    fsync_path(target)
    return time.perf_counter() - start


def direct_copy(template: Path, target: Path) -> float:
    """The same bytes with ``dd oflag=direct conv=fsync``: a copy that bypasses the page cache,
    as the publisher's writer does (the fastest plain copy on this kind of disk)."""
    start = time.perf_counter()
    target.mkdir()
    for src in sorted(template.glob("*.distcp")):
        subprocess.run(
            ["dd", f"if={src}", f"of={target / src.name}", "bs=16M", "oflag=direct", "conv=fsync"],
            check=True,
            capture_output=True,
        )
    return time.perf_counter() - start


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_shape(name: str, runs: int, root: Path, server: RedisServer, args: argparse.Namespace):
    work = root / name
    checkpoints, weights, template = work / "checkpoints", work / "weights", work / "template"
    for d in (checkpoints, weights):
        d.mkdir(parents=True)
    nbytes = write_template(template, SHAPES[name])
    keys = Keys(f"bench-{uuid.uuid4().hex[:6]}")
    client = redis.Redis.from_url(server.url)
    events = client.pubsub()
    events.subscribe(keys.events)
    env = {
        **os.environ,
        "WEIGHTCAST_REDIS_URL": server.url,
        "WEIGHTCAST_NAMESPACE": keys.namespace,
        "WEIGHTCAST_CHECKPOINT_DIR": str(checkpoints),
        "WEIGHTCAST_WEIGHTS_DIR": str(weights),
    }
    log = open(work / "publisher.log", "wb")  # noqa: SIM115 (closed below)
    command = [sys.executable, "-m", "weightcast", "publisher", "--tp", str(args.tp)]
    command += ["--reader", args.reader, "--rescan-seconds", "30"]
    daemon = subprocess.Popen(
        command,
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not client.get(keys.publisher_leader):
            assert daemon.poll() is None, (work / "publisher.log").read_text()
            assert time.monotonic() < deadline, "publisher did not start"
            time.sleep(0.1)
        raw, direct, publish = [], [], []
        for step in range(1, runs + 1):
            tmp = checkpoints / f".tmp-step-{step}"
            shutil.copytree(template, tmp)
            SnapshotInfo(uuid.uuid4().hex, "bench", step, time.time(), "bfloat16", name).write(tmp)
            settle()
            raw.append(raw_copy(template, weights / f".raw-{step}"))
            settle()
            direct.append(direct_copy(template, weights / f".direct-{step}"))
            settle()
            start = time.perf_counter()
            os.rename(tmp, checkpoints / f"step-{step}")
            while True:
                message = events.get_message(timeout=120)
                assert message is not None, (work / "publisher.log").read_text()
                if message["type"] == "message":
                    assert json.loads(message["data"])["event"] == "published"
                    break
            publish.append(time.perf_counter() - start)
            events.get_message(timeout=0.5)  # an eviction event, if any
            shutil.rmtree(weights / f".raw-{step}")
            shutil.rmtree(weights / f".direct-{step}")
        rss = peak_rss_mb(daemon.pid)
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        log.close()
        shutil.rmtree(work, ignore_errors=True)
    return nbytes, *(statistics.median(x) for x in (raw, direct, publish)), rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--reader", default="auto", choices=["auto", "dcp-load"])
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: /tmp)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wc-bench-", dir=args.dir))
    print(f"reader={args.reader} tp={args.tp} runs={args.runs} dir={root}")
    print(
        f"{'shape':>6} {'GB':>6} {'raw copy s':>10} {'dd direct s':>11} {'publish s':>10} "
        f"{'ratio':>6} {'vs dd':>6} {'RSS MB':>7}"
    )
    with RedisServer(root / "redis") as server:
        for name in args.shapes:
            runs = max(3, args.runs if name != "1.7B" else min(args.runs, 3))
            nbytes, raw, direct, publish, rss = bench_shape(name, runs, root, server, args)
            print(
                f"{name:>6} {nbytes / 1e9:6.2f} {raw:10.3f} {direct:11.3f} {publish:10.3f} "
                f"{publish / raw:6.2f} {publish / direct:6.2f} {rss:7.0f}",
                flush=True,
            )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
