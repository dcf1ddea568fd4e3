"""Update time of a real SGLang engine kept on versions by weightcast's SGLang node, against
reading the same bytes.

For each model shape the real publisher writes two versions, A and B (``--layout hf``), and a
CPU ``sglang.Engine`` (tp=1) starts from A's directory. Each run moves the engine to the other
version through :class:`~weightcast.client.sglang.engine.SglangNode` with a fresh client
(lease, verify and read every block, then SGLang's ``begin_weight_update`` /
``update_weights_from_tensor`` / ``end_weight_update`` and the weight version: what a node
pays for a version it holds no base for), split into the stage (weightcast's read) and the
swap (SGLang's). Baseline in the same run: reading the version's weights file into fresh
memory (``os.preadv``). The version's pages are dropped from the page cache before each.
Medians over the runs and the load average are printed.

It builds its engines with the SGLang tier's helpers (``tests/sglang/sglang_helpers.py``, the
``sgl_kernel`` stand-in included), so the tests' folders go on ``PYTHONPATH``:

    PYTHONPATH=tests:tests/sglang:tests/sglang/stand_in SGLANG_USE_CPU_ENGINE=1 \\
        .venv-sglang/bin/python -m bench sglang --shapes 0.6B --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import ENGINE_CONTEXT, cold_read, drop_pages, engine_versions

MEMORY = {"tiny": 0.05, "0.6B": 0.2}
"""SGLang's ``mem_fraction_static`` per shape: the weights must leave room for a KV cache."""


def bench_shape(name: str, runs: int, work: Path, redis_url: str) -> dict:
    from weightcast.client.sglang.engine import SglangNode, swap
    from weightcast.client.sglang.local_engine import LocalSglangEngine
    from weightcast.client.sglang.staging import stage
    from weightcast.client.weights import WeightsClient
    from weightcast.contract.model_shape import ModelShape

    from sglang_helpers import sglang_engine

    config, registry, versions = engine_versions(name, work, redis_url, "hf")
    started = time.perf_counter()
    times: dict[str, list[float]] = {k: [] for k in ("stage", "swap", "read")}
    load = [os.getloadavg()[0]]
    with sglang_engine(registry.versions[versions[0]], mem_fraction_static=MEMORY[name]) as engine:
        print(f"{name}: engine started in {time.perf_counter() - started:.1f}s", flush=True)
        local = LocalSglangEngine(engine)
        for run in range(runs):
            version = versions[(run + 1) % 2]
            directory = registry.versions[version]
            client = WeightsClient(
                redis_url, registry.weights_dir, namespace=registry.namespace, node_id="bench"
            )
            node = SglangNode(local, client, ModelShape.from_hf_config(config))
            drop_pages(directory)
            with client.lease(version) as info:
                began = time.perf_counter()
                staged = stage(client, info, node.shape)
                times["stage"].append(time.perf_counter() - began)
                began = time.perf_counter()
                swap(local, version, list(staged.tensors.items()))
                times["swap"].append(time.perf_counter() - began)
            client.close()
            (weights,) = directory.glob("*.safetensors")
            times["read"].append(cold_read(weights))
            load.append(os.getloadavg()[0])
        nbytes = staged.nbytes
    result: dict = {"shape": name, "bytes": nbytes, "runs": runs}
    result |= {f"{k}_s": statistics.median(v) for k, v in times.items()}
    total = [a + b for a, b in zip(times["stage"], times["swap"], strict=True)]
    ratio = statistics.median(t / r for t, r in zip(total, times["read"], strict=True))
    print(
        f"{name}: {nbytes / 1e6:.1f} MB; median stage (lease, verify, read) "
        f"{result['stage_s']:.3f}s, SGLang swap {result['swap_s']:.3f}s; read the file "
        f"{result['read_s']:.3f}s; update / read {ratio:.2f}x; load "
        f"{min(load):.1f}..{max(load):.1f}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", nargs="+", default=list(ENGINE_CONTEXT), choices=list(ENGINE_CONTEXT)
    )
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from weightcast.local.redis_server import RedisServer

    with (
        tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp,
        RedisServer(Path(tmp) / "redis") as server,
    ):
        for name in args.shapes:
            bench_shape(name, args.runs, Path(tmp), server.url)


if __name__ == "__main__":
    main()
