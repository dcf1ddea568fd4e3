"""Update time of a real vLLM engine through the weightcast backend, against reading the bytes.

For each model shape the real publisher writes two versions, A and B (``--layout both``), and
a CPU ``vllm.LLM`` (tp=1) starts from A's ``hf`` layout with the ``weightcast`` backend. Each
run then swaps the engine to the other version (``engine.swap``: start, update, finish, set
the version, reset the prefix cache: what a node pays) and reads, from the worker's report,
the backend's stage (lease, verify, read the rank's part) and apply (vLLM's layerwise reload,
CPU repacking included) times. Every update gets a verification record of its own, so each
one verifies every block, as the first update to a new version does. Baselines in the same
run, on the same version: reading its fused file into fresh memory (``os.preadv``, the raw
read of the other benchmarks) and the client alone (``WeightsClient``: verify and read every
tensor of the rank). Before each of the three the version's pages are dropped from the page
cache (``posix_fadvise(DONTNEED)``), as a version the publisher has just written with
``O_DIRECT`` is not in it. Medians over the runs,
the spread of the per-run ratios, and the load average are printed.

It builds its engines with the vLLM tier's helpers (``tests/vllm/vllm_helpers.py``), so the
tests' folders go on ``PYTHONPATH``:

    PYTHONPATH=tests:tests/vllm .venv-vllm/bin/python -m bench vllm   # tiny, 0.6B; 5 runs
    PYTHONPATH=tests:tests/vllm .venv-vllm/bin/python -m bench vllm --shapes 0.6B --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from common import ENGINE_CONTEXT, cold_read, drop_pages, engine_versions

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(report)


def bench_shape(name: str, runs: int, work: Path, redis_url: str) -> dict:
    from weightcast.client.vllm.backend import report
    from weightcast.client.vllm.engine import swap
    from weightcast.client.vllm.local_engine import LocalEngine
    from weightcast.client.weights import WeightsClient
    from weightcast.contract.layout import FUSED_WEIGHTS_FILE

    from vllm_helpers import llm_engine

    _, registry, versions = engine_versions(name, work, redis_url, "both")
    started = time.perf_counter()
    kinds = ("swap", "stage", "apply", "read", "client")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    load = [os.getloadavg()[0]]
    with llm_engine(registry.versions[versions[0]] / "hf") as llm:
        print(f"{name}: engine started in {time.perf_counter() - started:.1f}s", flush=True)
        engine = LocalEngine(llm)
        engine.init_weight_transfer_engine(
            {
                "redis_url": redis_url,
                "namespace": registry.namespace,
                "weights_root": str(registry.weights_dir),
                "node_id": "bench",
            }
        )
        for run in range(runs):
            version = versions[(run + 1) % 2]
            directory = registry.versions[version]
            drop_pages(directory)
            began = time.perf_counter()
            swap(engine, version, {"verified_dir": str(work / f"verified-{name}-{run}")})
            times["swap"].append(time.perf_counter() - began)
            (worker,) = llm.collective_rpc(report)
            times["stage"].append(worker["stage_s"])
            times["apply"].append(worker["apply_s"])
            times["read"].append(cold_read(directory / FUSED_WEIGHTS_FILE))
            client = WeightsClient(  # a fresh client verifies again, as a worker does
                redis_url, registry.weights_dir, namespace=registry.namespace, node_id="bench"
            )
            drop_pages(directory)
            began = time.perf_counter()
            client.rank_tensors(version, 0, 1)
            times["client"].append(time.perf_counter() - began)
            client.close()
            load.append(os.getloadavg()[0])
        nbytes = worker["bytes"]
    result: dict = {"shape": name, "bytes": nbytes, "runs": runs, "load": [min(load), max(load)]}
    result |= {f"{k}_s": statistics.median(v) for k, v in times.items()}
    for kind, base in (("swap", "read"), ("stage", "read"), ("swap", "client")):
        ratios = [a / b for a, b in zip(times[kind], times[base], strict=True)]
        result[f"{kind}/{base}"] = (statistics.median(ratios), min(ratios), max(ratios))
    ratios = ", ".join(
        f"{key} {v[0]:.2f}x ({v[1]:.2f}..{v[2]:.2f})" for key, v in result.items() if "/" in key
    )
    print(
        f"{name}: {nbytes / 1e6:.1f} MB; median swap {result['swap_s']:.3f}s "
        f"(stage {result['stage_s']:.3f}s, apply {result['apply_s']:.3f}s); read the file "
        f"{result['read_s']:.3f}s, client verify+read {result['client_s']:.3f}s; {ratios}; "
        f"load {min(load):.1f}..{max(load):.1f}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", nargs="+", default=list(ENGINE_CONTEXT), choices=list(ENGINE_CONTEXT)
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    from weightcast.local.redis_server import RedisServer

    with (
        tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp,
        RedisServer(Path(tmp) / "redis") as server,
    ):
        results = [bench_shape(name, args.runs, Path(tmp), server.url) for name in args.shapes]
    if args.json:
        machine = f"{platform.node()}, {os.cpu_count()} CPUs"
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=1))


if __name__ == "__main__":
    main()
