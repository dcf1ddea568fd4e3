"""Every CUDA benchmark in one run (< 8 min on one H200): JSON and a markdown table.

1. trainer overhead: step time with a snapshot every step (pinned staging, background write)
   against none, Qwen3-0.6B on the GPU (``bench_trainer.py``);
2. publish: a 0.6B-shaped snapshot through the real daemon against cp + fsync of the same
   bytes, with the daemon's peak RSS (``bench_publisher.py``);
3. end-to-end freshness: trainer snapshot start -> registered -> a node of T workers (tp 1,
   2, 4, 8, one GPU) holding its rank's part on the GPU, against one raw write + one raw
   read of the bytes (``bench_freshness.py``);
4. publish of an 8B-shaped snapshot (16.4 GB; about 50 GB of disk: the template, a version
   and the next one before eviction), last, as it is the longest.

Each step runs as its own process with a time limit, cut to what is left of
:data:`BUDGET_S` for the whole run; a failed or timed-out step is recorded and the next one
runs. ``--dry`` (the default without CUDA) runs the same steps on tiny shapes and the CPU,
to check the script itself.

    .venv/bin/python bench/gpu.py --out bench-gpu        # on the GPU machine
    .venv/bin/python bench/gpu.py --dry --out /tmp/dry   # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


BUDGET_S = 450
"""The whole run's limit, from this script's start: 7.5 minutes, half a minute under the 8
it must fit in. The steps' own limits add up to 7 minutes."""


def steps(dry: bool) -> list[tuple[str, list[str], int]]:
    """(name, argv, time limit in seconds) of each benchmark, in the order they run."""
    model = "tiny" if dry else "0.6B"
    trainer = ["--models", model, "--repeats", "1", "--steps", "8"]
    publish = ["--shapes", model, "--rounds", "3"]
    publish_8b = ["--shapes", "tiny" if dry else "8B", "--rounds", "2"]
    tps = ["1", "2", "4"] if dry else ["1", "2", "4", "8"]  # tiny has 4 heads
    fresh = ["--shape", model, "--tp", *tps, "--rounds", "3"]
    fresh += ["--device", "cpu" if dry else "cuda"]
    return [
        ("trainer", [sys.executable, str(HERE / "bench_trainer.py"), *trainer], 150),
        ("publish", [sys.executable, str(HERE / "bench_publisher.py"), *publish], 45),
        ("freshness", [sys.executable, str(HERE / "bench_freshness.py"), *fresh], 90),
        ("publish-8B", [sys.executable, str(HERE / "bench_publisher.py"), *publish_8b], 135),
    ]


def run_step(argv: list[str], limit: int) -> tuple[int | None, str, str]:
    """Run one benchmark in a session of its own; (exit status or None when it ran over
    ``limit`` and was killed with everything it started, stdout, stderr)."""
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its publisher, nodes and redis-server too
        stdout, stderr = process.communicate()
        return None, stdout, stderr
    return process.returncode, stdout, stderr


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
    for step in ("publish", "publish-8B"):
        for row in (report.get(step) or {}).get("results", []):
            lines.append(
                f"| publish {row['shape']} ({row['bytes'] / 1e9:.2f} GB) | publish / cp+fsync, "
                f"median of {row['rounds']} | {row['ratio']:.3f}x ({row['ratio_min']:.2f}.."
                f"{row['ratio_max']:.2f}); {row['publish_s']:.2f} s; "
                f"RSS {row['peak_rss_mb']:.0f} MB |"
            )
    fresh = report.get("freshness") or {}
    for row in fresh.get("results", []):
        lines.append(
            f"| freshness {fresh['shape']}, tp {row['tp']} node ({fresh['device']}) | "
            f"snapshot start -> node loaded / (raw write + raw read) | {row['ratio']:.2f}x "
            f"({row['ratio_min']:.2f}..{row['ratio_max']:.2f}); {row['total']:.2f} s = "
            f"snapshot {row['snapshot']:.2f} + publish {row['publish']:.2f} + node "
            f"{row['node']:.2f}; floor {row['floor']:.2f} s |"
        )
    for name, error in report["errors"].items():
        lines.append(f"| {name} | FAILED | {error} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-gpu"))
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    deadline = time.monotonic() + BUDGET_S
    try:
        import torch

        dry = args.dry or not torch.cuda.is_available()
    except ImportError:
        dry = True
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": machine(), "dry": dry, "errors": {}, "seconds": {}}
    work = args.out / "work"
    for name, command, step_limit in steps(dry):
        argv = [*command, "--json", str(args.out / f"{name}.json")]
        if name != "trainer":
            argv += ["--dir", str(work)]
        begin = time.monotonic()
        limit = min(step_limit, int(deadline - begin))
        if limit < 10:
            report["errors"][name] = f"not run: {BUDGET_S} s budget spent"
            continue
        print(f"== {name} (limit {limit} s): {' '.join(argv[1:])}", flush=True)
        work.mkdir(exist_ok=True)
        returncode, stdout, stderr = run_step(argv, limit)
        print(stdout[-4000:], flush=True)
        if returncode is None:
            report["errors"][name] = f"over its {limit} s limit: {stderr[-400:]}"
        elif returncode != 0:
            report["errors"][name] = f"exit {returncode}: {stderr[-400:]}"
        else:
            report[name] = json.loads((args.out / f"{name}.json").read_text())
        shutil.rmtree(work, ignore_errors=True)  # what a killed step left (8B: tens of GB)
        report["seconds"][name] = round(time.monotonic() - begin, 1)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    (args.out / "results.md").write_text(markdown(report))
    print(markdown(report))
    sys.exit(1 if report["errors"] else 0)


if __name__ == "__main__":
    main()
