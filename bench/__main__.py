"""The benchmarks' one entry point: ``python -m bench NAME [ARGS]`` runs ``bench/NAME`` with
ARGS, exactly as ``python bench/SCRIPT ARGS`` does (the script's own flags; ``--help``);
``python -m bench`` lists the benchmarks. Run it from the repository root, with weightcast
installed (``.venv/bin/python -m bench ...``); docs/benchmarks.md has each one's command,
conditions and figures.

The script replaces this process (``os.execv``), so that its exit status, signals and ``sys.path``
(``bench/`` first: the scripts import each other and :mod:`common` by name) are its own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

BENCHMARKS = {
    "publisher": ("bench_publisher.py", "a publish against cp + fsync of the same bytes"),
    "node": ("bench_node.py", "a node's read of its rank's part against the raw read"),
    "trainer": ("bench_trainer.py", "train-step time with a snapshot (or checkpoint) every step"),
    "resume": ("bench_resume.py", "the trainer on its device: snapshots, a checkpoint, a resume"),
    "freshness": ("bench_freshness.py", "trainer snapshot start -> a tp-T node loaded"),
    "delta": ("bench_delta.py", "delta versions: size, publish cost, a node's update by delta"),
    "delta-encode": ("bench_delta_encode.py", "a delta's encoding, stage by stage"),
    "delta-memory": ("delta_memory.py", "a node's read of a version of very many blocks"),
    "memory": ("bench_memory.py", "peak memory of the publisher and a node at real sizes"),
    "store": ("bench_store.py", "the object-store transport against s5cmd"),
    "s3-baseline": ("s3_baseline.py", "raw S3 throughput: s5cmd and ranged HTTP GETs"),
    "inplace": ("bench_inplace.py", "the vLLM backend's in-place load into engine-shaped tensors"),
    "vllm": ("bench_vllm.py", "a real vLLM engine's update (the vLLM venv; tests on PYTHONPATH)"),
    "sglang": ("bench_sglang.py", "a real SGLang engine's update (the SGLang venv)"),
    "gpu": ("gpu.py", "the GPU machine's steps (bench/gpu.sh installs, then runs it)"),
}
"""Name: (the script in ``bench/``, what it measures)."""


def usage() -> str:
    lines = ["usage: python -m bench NAME [ARGS]  (python -m bench NAME --help: its flags)", ""]
    lines += [f"  {name:<13} {what}" for name, (_, what) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(usage())
        return
    name, *rest = argv
    if name not in BENCHMARKS:
        sys.exit(f"python -m bench: no benchmark {name!r}\n\n{usage()}")
    script = str(HERE / BENCHMARKS[name][0])
    os.execv(sys.executable, [sys.executable, script, *rest])


if __name__ == "__main__":
    main(sys.argv[1:])
