"""The GPU machine's benchmark steps (``bench/gpu.sh`` installs what they need, then runs this).

1. ``trainer``: Qwen3-0.6B on ``cuda:0``, B=8, T=2048: a snapshot every step, a resume
   checkpoint, a resume; the last snapshot equals the checkpoint's weights in bf16; the step
   time with and without a snapshot every step (``bench_resume.py``);
2. ``publish-tp1``, ``publish-tp2``: a 0.6B-shaped snapshot through the real publisher
   against cp + fsync of the same bytes (``bench_publisher.py``);
3. ``inplace``: the vLLM backend's in-place copy into CUDA tensors shaped like vLLM's
   parameters at tp 1 and 2: equal bytes, unchanged ``data_ptr``, a CUDA graph replayed
   after the update; GB/s against blocking copies (``bench_inplace.py``);
4. ``freshness-tp1``, ``freshness-tp2``: snapshot start -> registered -> a node holding its
   rank's part on the GPU, one round each, by full version and by delta
   (``bench_freshness.py --modes full delta``).

Each step runs as its own process with its own time limit, cut to what is left of
:data:`BUDGET_S`; it writes ``<out>/<step>.json`` when it ends, and this script rewrites
``<out>/results.json`` (every step so far, failures and timings) after each step, so a
step that runs over loses only its own figures. ``--dry`` runs the same steps on tiny shapes
and the CPU (a test runs it, so the script cannot rot), with no budget and each step's limit
only a guard against a hang: how fast they run on a loaded CPU says nothing.
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

BUDGET_S = 330
"""All steps together: within the 6 minutes the machine gives the run, after the install."""
DRY_LIMIT_S = 900
"""Each step's limit with ``--dry``: a hang, not a slow machine (idle, a step takes 10-35 s)."""


def steps(dry: bool, work: Path) -> list[tuple[str, list[str], int]]:
    """(name, arguments of the bench script, time limit in seconds), in the order they run;
    the steps that write files write them under ``work``. The limits are the GPU run's;
    ``--dry`` replaces them with :data:`DRY_LIMIT_S`."""
    shape, device = ("tiny", "cpu") if dry else ("0.6B", "cuda")
    files = ["--dir", str(work)]
    batch = (
        ["--batch-size", "4", "--seq-len", "64"]
        if dry
        else ["--batch-size", "8", "--seq-len", "2048"]
    )
    trainer = ["bench_resume.py", "--model", shape, "--steps", "3" if dry else "6", *batch, *files]
    listed = [("trainer", trainer, 150)]
    for tp in ("1", "2"):
        rounds = "1" if dry else "3"
        publish = ["bench_publisher.py", "--shapes", shape, "--rounds", rounds, "--tp", tp, *files]
        listed.append((f"publish-tp{tp}", publish, 30))
    inplace = ["bench_inplace.py", "--shape", shape, "--tp", "1", "2", "--device", device]
    listed.append(("inplace", inplace, 40))
    for tp in ("1", "2"):
        fresh = ["bench_freshness.py", "--shape", shape, "--tp", tp, "--rounds", "1"]
        fresh += ["--modes", "full", "delta"]
        listed.append((f"freshness-tp{tp}", [*fresh, "--device", device, *files], 45))
    return listed


def run_step(argv: list[str], limit: int) -> tuple[int | None, str, str]:
    """Run one benchmark in a session of its own; (exit status, or None when it ran over
    ``limit`` and was killed with everything it started; stdout; stderr)."""
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its trainer, publisher, nodes, redis-server
        stdout, stderr = process.communicate()
        return None, stdout, stderr
    return process.returncode, stdout, stderr


def machine() -> dict:
    import torch

    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    deadline = time.monotonic() + BUDGET_S
    import torch

    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry for the CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"machine": machine(), "dry": args.dry, "errors": {}, "seconds": {}}
    work = args.out / "work"
    for name, command, step_limit in steps(args.dry, work):
        script, *rest = command
        argv = [sys.executable, str(HERE / script), *rest, "--json", str(args.out / f"{name}.json")]
        begin = time.monotonic()
        limit = DRY_LIMIT_S if args.dry else min(step_limit, int(deadline - begin))
        if limit < 10:
            report["errors"][name] = f"not run: the {BUDGET_S} s budget is spent"
        else:
            print(f"== {name} (limit {limit} s): {' '.join(argv[1:])}", flush=True)
            work.mkdir(exist_ok=True)
            returncode, stdout, stderr = run_step(argv, limit)
            print(stdout[-4000:], flush=True)
            if returncode is None:
                report["errors"][name] = f"over its {limit} s limit: {stderr[-600:]}"
            elif returncode != 0:
                report["errors"][name] = f"exit {returncode}: {stderr[-600:]}"
            else:
                report[name] = json.loads((args.out / f"{name}.json").read_text())
            shutil.rmtree(work, ignore_errors=True)  # what a killed step left behind
        report["seconds"][name] = round(time.monotonic() - begin, 1)
        (args.out / "results.json").write_text(json.dumps(report, indent=1))
    for name, error in report["errors"].items():
        print(f"FAILED {name}: {error}", file=sys.stderr)
    sys.exit(1 if report["errors"] else 0)


if __name__ == "__main__":
    main()
