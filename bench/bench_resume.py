"""The trainer on its device: a snapshot every step, a resume checkpoint, a resume.

Two real ``weightcast trainer`` processes on a private redis-server, batches queued in
advance. The first trains ``--steps`` steps with a snapshot every step and ends with its
resume checkpoint; the second resumes from it and trains ``--steps`` more without a snapshot
until its end. Checks: the second run resumed at the first one's step; the first run's last
snapshot (HF names, bf16) equals the resume checkpoint's model weights (torchtitan names,
float32) mapped to HF names and cast to bf16, bit for bit. Figures: the median step time of
each run after ``--warmup`` steps (the loop's own ``seconds``: with and without a snapshot
every step) and their ratio.

    python -m bench resume --model 0.6B --batch-size 8 --seq-len 2048   # a GPU
    .venv/bin/python -m bench resume --model tiny                        # the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from bench_trainer import run_trainer
from common import save_json
from weightcast.client.producer import BatchProducer
from weightcast.contract.snapshot_format import read_complete
from weightcast.local.produce import synthetic_batch
from weightcast.local.redis_server import RedisServer
from weightcast_publisher.dcp_load import load_tensors
from weightcast_publisher.snapshot_scan import Snapshot
from weightcast_trainer.model import flavor_args
from weightcast_trainer.resume import newest_checkpoint, read_model_weights

NAMESPACE = "bench-resume"


def train(work: Path, redis_url: str, args: argparse.Namespace, steps: int, publish: int) -> list:
    """One trainer run up to ``steps`` (in all); its JSON log events."""
    return run_trainer(
        redis_url,
        NAMESPACE,
        work,
        *("--model", args.model, "--steps", str(steps), "--publish-every", str(publish)),
        *("--seq-len", str(args.seq_len), "--resume-dir", str(work / "resume")),
    )


def step_seconds(events: list, warmup: int) -> list[float]:
    return [e["seconds"] for e in events if e["event"] == "step"][warmup:]


def checkpoint_as_hf(resume: Path, model: str) -> dict[str, torch.Tensor]:
    """The newest resume checkpoint's model weights under HF names, in bf16."""
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    found = newest_checkpoint(resume)
    if found is None:
        raise SystemExit(f"no complete resume checkpoint in {resume}")
    state = read_model_weights(found[1])
    hf = Qwen3StateDictAdapter(flavor_args(model), None).to_hf(state)
    return {name: tensor.to(torch.bfloat16) for name, tensor in hf.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: /tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    vocab = flavor_args(args.model).vocab_size
    with (
        tempfile.TemporaryDirectory(dir=args.dir) as tmp,
        RedisServer(Path(tmp) / "redis") as server,
    ):
        work = Path(tmp)
        producer = BatchProducer(server.url, NAMESPACE, name="bench", max_pending=0)
        generator = torch.Generator().manual_seed(0)
        for _ in range(2 * args.steps):
            producer.push(synthetic_batch(generator, args.batch_size, args.seq_len, vocab), 0)
        first = train(work, server.url, args, args.steps, publish=1)
        snapshot_dir = work / "checkpoints" / f"step-{args.steps}"
        snapshot = load_tensors(Snapshot(snapshot_dir, read_complete(snapshot_dir)))
        weights = checkpoint_as_hf(work / "resume", args.model)
        differing = sorted(n for n, t in snapshot.items() if not torch.equal(t, weights[n]))
        if not snapshot or differing:
            raise SystemExit(f"step-{args.steps} snapshot differs from the checkpoint: {differing}")
        second = train(work, server.url, args, 2 * args.steps, publish=2 * args.steps + 1)
        resumed = next(e for e in second if e["event"] == "resumed")
        if resumed["step"] != args.steps:
            raise SystemExit(f"resumed at step {resumed['step']}, not {args.steps}")
    with_snapshots = statistics.median(step_seconds(first, args.warmup))
    without = statistics.median(step_seconds(second, args.warmup))
    report = {
        "model": args.model,
        "batch": [args.batch_size, args.seq_len],
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "steps": args.steps,
        "step_s_snapshot_every_step": with_snapshots,
        "step_s_no_snapshot": without,
        "ratio": with_snapshots / without,
        "snapshot_equals_checkpoint": len(snapshot),
        "resumed_at": resumed["step"],
    }
    print(json.dumps(report, indent=1))
    save_json(args.json, report)


if __name__ == "__main__":
    main()
