"""Train-step time with a snapshot (or a resume checkpoint) every step, as the loop sees it.

Runs ``weightcast trainer`` as a real process on a private redis-server, with batches
queued in advance, alternating two settings ``--repeats`` times per model. ``--compare
snapshot`` (the default): ``--publish-every 1`` against no snapshot until the end, no resume
checkpoint until the end. ``--compare checkpoint``: a resume checkpoint every step written
synchronously (``async_mode = "disabled"``) against one written in the background
(``"async"``), no snapshot until the end. A step's time is the loop's own ``seconds`` (train
step, plus copying the weights off the device when a snapshot starts, plus the resume
checkpoint, or its staging copy when async); the first ``--warmup`` steps of a run are left
out. Prints, per model, the median step time of each setting (median over runs of the per-run
medians), their ratio, and for checkpoints the median time a checkpoint took to write.

    .venv/bin/python -m bench trainer                       # tiny and small on CPU
    .venv/bin/python -m bench trainer --compare checkpoint
    .venv/bin/python -m bench trainer --models 0.6B --batch-size 8 --seq-len 2048
"""

from __future__ import annotations

import argparse
import dataclasses
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

from common import REPO, save_json, weightcast_env
from weightcast.client.producer import BatchProducer
from weightcast.local.produce import synthetic_batch
from weightcast.local.redis_server import RedisServer
from weightcast_trainer.model import flavor_args

SETTINGS = {
    "snapshot": (("never", False, ""), ("every step", True, "")),
    "checkpoint": (("sync", False, "disabled"), ("async", False, "async")),
}
"""Per comparison, the baseline and the measured setting: name, snapshot every step, and
the resume checkpoints' ``async_mode`` (every step; "" = only at the end)."""


@dataclasses.dataclass
class RunResult:
    steps: list[float]  # the loop's step seconds after warm-up
    skipped: int  # snapshots skipped as the previous write was running
    checkpoint_seconds: list[float]  # how long each resume checkpoint took to write


def run_trainer(redis_url: str, namespace: str, run_dir: Path, *args: str) -> list[dict]:
    """``weightcast trainer <args>`` with its snapshots and weights under ``run_dir``, to its
    end; its JSON log events (exits naming the failure when the trainer failed)."""
    env = weightcast_env(redis_url, namespace, run_dir / "checkpoints", run_dir / "weights")
    command = [sys.executable, "-m", "weightcast", "trainer", *args, "--log-format", "json"]
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"trainer failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]


def run_once(
    redis_url: str,
    workdir: Path,
    model: str,
    setting: tuple[str, bool, str],
    args: argparse.Namespace,
) -> RunResult:
    """One trainer run in one setting."""
    _, snapshots, async_mode = setting
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    producer = BatchProducer(redis_url, namespace, name="bench", max_pending=0)
    generator = torch.Generator().manual_seed(0)
    vocab = flavor_args(model).vocab_size
    for _ in range(args.steps):
        producer.push(synthetic_batch(generator, args.batch_size, args.seq_len, vocab), 0)
    run_dir = workdir / namespace
    config = run_dir / "bench.toml"
    run_dir.mkdir(parents=True)
    if async_mode:
        config.write_text(f'[trainer.checkpoint]\ninterval = 1\nasync_mode = "{async_mode}"\n')
    else:
        config.write_text(f"[trainer.checkpoint]\ninterval = {args.steps + 1}\n")
    events = run_trainer(
        redis_url,
        namespace,
        run_dir,
        *("--config", str(config), "--model", model, "--steps", str(args.steps)),
        *("--publish-every", str(1 if snapshots else args.steps + 1)),
        *("--seq-len", str(args.seq_len)),
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    return RunResult(
        steps=[e["seconds"] for e in events if e["event"] == "step"][args.warmup :],
        skipped=next(e["publish_skipped"] for e in events if e["event"] == "trainer stopped"),
        checkpoint_seconds=[e["seconds"] for e in events if e["event"] == "resume checkpoint"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=sorted(SETTINGS), default="snapshot")
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default by model)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=0, help="default by model")
    parser.add_argument("--seq-len", type=int, default=0, help="default by model")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    options = parser.parse_args()
    results = []
    defaults = {"tiny": (30, 4, 64), "small": (10, 2, 256)}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, cuda={torch.cuda.is_available()}")
    base_name, measured_name = (name for name, _, _ in SETTINGS[options.compare])
    print(
        f"model    params  snapshot  B x T       {base_name + ' (s)':>10}  "
        f"{measured_name + ' (s)':>14}  ratio  skipped"
        + ("  checkpoint write (s)" if options.compare == "checkpoint" else "")
    )
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as server:
        for model in options.models:
            steps, batch, seq = defaults.get(model, (10, 8, 2048))
            args = argparse.Namespace(
                steps=options.steps or steps,
                warmup=options.warmup,
                batch_size=options.batch_size or batch,
                seq_len=options.seq_len or seq,
            )
            medians: dict[str, list[float]] = {base_name: [], measured_name: []}
            writes: dict[str, list[float]] = {base_name: [], measured_name: []}
            skipped = 0
            for _ in range(options.repeats):
                for setting in SETTINGS[options.compare]:
                    name = setting[0]
                    result = run_once(server.url, Path(tmp), model, setting, args)
                    medians[name].append(statistics.median(result.steps))
                    writes[name].append(statistics.median(result.checkpoint_seconds))
                    skipped += result.skipped if setting[1] else 0
            base = statistics.median(medians[base_name])
            measured = statistics.median(medians[measured_name])
            written = "  ".join(
                f"{name} {statistics.median(times):.4f}" for name, times in writes.items()
            )
            flavor = flavor_args(model)
            params = flavor.vocab_size * flavor.dim + flavor.n_layers * (
                flavor.dim * flavor.head_dim * (2 * flavor.n_heads + 2 * flavor.n_kv_heads)
                + 3 * flavor.dim * flavor.hidden_dim
            )
            spread = [
                m / b for m, b in zip(medians[measured_name], medians[base_name], strict=True)
            ]
            results.append(
                {
                    "model": model,
                    "compare": options.compare,
                    base_name: base,
                    measured_name: measured,
                    "ratio": measured / base,
                    "ratio_min": min(spread),
                    "ratio_max": max(spread),
                    "skipped": skipped,
                    "cuda": torch.cuda.is_available(),
                }
            )
            print(
                f"{model:<8} {params / 1e6:5.0f}M  {params * 2 / 1e9:5.2f} GB  "
                f"{args.batch_size} x {args.seq_len:<6}  {base:10.4f}  {measured:14.4f}  "
                f"{measured / base:5.2f}x  {skipped}/{options.repeats * (args.steps - 1)}  "
                + (written if options.compare == "checkpoint" else "")
            )
    save_json(options.json, results)


if __name__ == "__main__":
    main()
