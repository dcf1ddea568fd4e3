"""Every CUDA benchmark in one run (< 8 min on one H200): JSON and a markdown table.

1. trainer overhead: step time with a snapshot every step (pinned staging, background write)
   against none, Qwen3-0.6B on the GPU (``bench_trainer.py``);
2. publish: 0.6B- and 8B-shaped snapshots through the real daemon against cp + fsync of the
   same bytes, with the daemon's peak RSS (``bench_publisher.py``);
3. end-to-end freshness: snapshot rename -> published -> two nodes holding the weights on the
   GPU (``bench_freshness.py``).

Each step runs as its own process with a time limit; a failed step is recorded and the next
one runs. ``--dry`` (the default without CUDA) runs the same steps on tiny shapes and the CPU,
to check the script itself.

    .venv/bin/python bench/gpu.py --out bench-gpu        # on the GPU machine
    .venv/bin/python bench/gpu.py --dry --out /tmp/dry   # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def steps(dry: bool) -> list[tuple[str, list[str], int]]:
    """(name, argv, time limit in seconds) of each benchmark."""
    model = "tiny" if dry else "0.6B"
    trainer = ["--models", model, "--repeats", "1", "--steps", "8"]
    publish = ["--shapes", *(["tiny"] if dry else ["0.6B", "8B"]), "--rounds", "3"]
    fresh = [
        "--shape",
        model,
        "--nodes",
        "2",
        "--rounds",
        "3",
        "--device",
        "cpu" if dry else "cuda",
    ]
    return [
        ("trainer", [sys.executable, str(HERE / "bench_trainer.py"), *trainer], 180),
        ("publish", [sys.executable, str(HERE / "bench_publisher.py"), *publish], 240),
        ("freshness", [sys.executable, str(HERE / "bench_freshness.py"), *fresh], 90),
    ]


def machine() -> dict:
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def markdown(report: dict) -> str:
    lines = [f"Machine: {report['machine']}", ""]
    lines += ["| benchmark | figure | value |", "|---|---|---|"]
    for row in report.get("trainer") or []:
        lines.append(
            f"| trainer {row['model']} (cuda={row['cuda']}) | step with a snapshot every step / "
            f"without | {row['ratio']:.3f}x ({row['ratio_min']:.3f}..{row['ratio_max']:.3f}) |"
        )
    for row in (report.get("publish") or {}).get("results", []):
        lines.append(
            f"| publish {row['shape']} ({row['bytes'] / 1e9:.2f} GB) | publish / cp+fsync, "
            f"median of {row['rounds']} | {row['ratio']:.3f}x ({row['ratio_min']:.2f}.."
            f"{row['ratio_max']:.2f}); {row['publish_s']:.2f} s; RSS {row['peak_rss_mb']:.0f} MB |"
        )
    fresh = report.get("freshness")
    if fresh:
        lines.append(
            f"| freshness {fresh['shape']} -> {fresh['nodes']} nodes ({fresh['device']}) | "
            f"rename -> every node loaded | {fresh['all_nodes_loaded_s']:.2f} s (published "
            f"{fresh['published_s']:.2f} s) |"
        )
    for name, error in report["errors"].items():
        lines.append(f"| {name} | FAILED | {error} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-gpu"))
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    try:
        import torch

        dry = args.dry or not torch.cuda.is_available()
    except ImportError:
        dry = True
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": machine(), "dry": dry, "errors": {}, "seconds": {}}
    for name, command, limit in steps(dry):
        argv = [*command, "--json", str(args.out / f"{name}.json")]
        begin = time.monotonic()
        print(f"== {name}: {' '.join(argv[1:])}", flush=True)
        try:
            done = subprocess.run(argv, timeout=limit, capture_output=True, text=True)
            print(done.stdout[-4000:], flush=True)
            if done.returncode != 0:
                report["errors"][name] = f"exit {done.returncode}: {done.stderr[-400:]}"
            else:
                report[name] = json.loads((args.out / f"{name}.json").read_text())
        except subprocess.TimeoutExpired:
            report["errors"][name] = f"over its {limit} s limit"
        report["seconds"][name] = round(time.monotonic() - begin, 1)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    (args.out / "results.md").write_text(markdown(report))
    print(markdown(report))
    sys.exit(1 if report["errors"] else 0)


if __name__ == "__main__":
    main()
