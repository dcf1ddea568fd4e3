"""Train-step time with a snapshot every step versus never, as the loop sees it.

Runs ``weightcast trainer`` as a real process on a private redis-server, with batches
queued in advance, once with ``--publish-every 1`` and once with no snapshot until the end,
alternating, ``--repeats`` times per model. A step's time is the loop's own ``seconds``
(train step, plus copying the weights off the device when a snapshot starts); the first
``--warmup`` steps of a run are left out. Prints, per model, the median step time of each
mode (median over runs of the per-run medians) and their ratio.

    .venv/bin/python bench/bench_trainer.py                       # tiny and small on CPU
    .venv/bin/python bench/bench_trainer.py --models 0.6B --batch-size 8 --seq-len 2048
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
import uuid
from pathlib import Path

import torch

import trainer  # noqa: F401  (must precede torchtitan: picks the CPU device type)
from shared.producer import BatchProducer, synthetic_batch
from shared.redis_server import RedisServer
from trainer.model import flavor_args

REPO = Path(__file__).resolve().parent.parent


def run_once(
    redis_url: str, workdir: Path, model: str, publish_every: int, args: argparse.Namespace
) -> tuple[list[float], int]:
    """One trainer run: the step times after warm-up and how many snapshots it skipped."""
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    producer = BatchProducer(redis_url, namespace, name="bench", max_pending=0)
    generator = torch.Generator().manual_seed(0)
    vocab = flavor_args(model).vocab_size
    for _ in range(args.steps):
        producer.push(synthetic_batch(generator, args.batch_size, args.seq_len, vocab), 0)
    run_dir = workdir / namespace
    config = run_dir / "bench.toml"
    run_dir.mkdir(parents=True)
    config.write_text(f"[trainer.checkpoint]\ninterval = {args.steps + 1}\n")
    env = {
        **os.environ,
        "WEIGHTCAST_REDIS_URL": redis_url,
        "WEIGHTCAST_NAMESPACE": namespace,
        "WEIGHTCAST_CHECKPOINT_DIR": str(run_dir / "checkpoints"),
        "WEIGHTCAST_WEIGHTS_DIR": str(run_dir / "weights"),
    }
    command = [
        sys.executable,
        "-m",
        "shared.cli",
        "trainer",
        "--config",
        str(config),
        "--model",
        model,
        "--steps",
        str(args.steps),
        "--publish-every",
        str(publish_every),
        "--seq-len",
        str(args.seq_len),
        "--log-format",
        "json",
    ]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    if result.returncode != 0:
        raise SystemExit(f"trainer failed:\n{result.stderr[-3000:]}")
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    steps = [e["seconds"] for e in events if e["event"] == "step"][args.warmup :]
    skipped = next(e["publish_skipped"] for e in events if e["event"] == "trainer stopped")
    return steps, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default by model)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=0, help="default by model")
    parser.add_argument("--seq-len", type=int, default=0, help="default by model")
    options = parser.parse_args()
    defaults = {"tiny": (30, 4, 64), "small": (10, 2, 256)}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, cuda={torch.cuda.is_available()}")
    print("model    params  snapshot  B x T       never (s)  every step (s)  ratio  skipped")
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        for model in options.models:
            steps, batch, seq = defaults.get(model, (10, 8, 2048))
            args = argparse.Namespace(
                steps=options.steps or steps,
                warmup=options.warmup,
                batch_size=options.batch_size or batch,
                seq_len=options.seq_len or seq,
            )
            medians: dict[str, list[float]] = {"never": [], "every": []}
            skipped = 0
            for _ in range(options.repeats):
                for mode, every in (("never", args.steps + 1), ("every", 1)):
                    times, skips = run_once(server.url, Path(tmp), model, every, args)
                    medians[mode].append(statistics.median(times))
                    skipped += skips if mode == "every" else 0
            never = statistics.median(medians["never"])
            every = statistics.median(medians["every"])
            flavor = flavor_args(model)
            params = flavor.vocab_size * flavor.dim + flavor.n_layers * (
                flavor.dim * flavor.head_dim * (2 * flavor.n_heads + 2 * flavor.n_kv_heads)
                + 3 * flavor.dim * flavor.hidden_dim
            )
            print(
                f"{model:<8} {params / 1e6:5.0f}M  {params * 2 / 1e9:5.2f} GB  "
                f"{args.batch_size} x {args.seq_len:<6}  {never:9.4f}  {every:14.4f}  "
                f"{every / never:5.2f}x  {skipped}/{options.repeats * (args.steps - 1)}"
            )


if __name__ == "__main__":
    main()
