"""Update time of a real vLLM engine through the weightcast backend, against reading the bytes.

For each model shape the real publisher writes two versions, A and B (``--layout both``), and
a CPU ``vllm.LLM`` (tp=1) starts from A's ``hf`` layout with the ``weightcast`` backend. Each
run then swaps the engine to the other version (``driver.swap``: start, update, finish, set
the version, reset the prefix cache: what a node pays) and reads, from the worker's report,
the backend's stage (lease, verify, read the rank's part) and apply (vLLM's layerwise reload,
CPU repacking included) times. Baselines in the same run, on the same version: reading its
fused file into memory (``readinto``; the page cache is as warm as for the swap) and the
client alone (``WeightsClient``: verify and read every tensor of the rank). Medians over the
runs and the ratios are printed.

    .venv-vllm/bin/python bench/bench_vllm.py                  # tiny and 0.6B, 5 runs
    .venv-vllm/bin/python bench/bench_vllm.py --shapes 0.6B --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "vllm"), str(REPO / "tests")]
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(report)

SHAPES = {
    "tiny": {},
    "0.6B": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        max_window_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
    ),
}


def read_file(path: Path) -> int:
    """Read a file into memory the plain way; the bytes read."""
    buffer = bytearray(os.path.getsize(path))
    with open(path, "rb", buffering=0) as f:
        return f.readinto(buffer)


def bench_shape(name: str, runs: int, work: Path, redis_url: str) -> dict[str, float]:
    from weightcast.client.vllm.backend import report
    from weightcast.client.vllm.driver import LocalEngine, swap
    from weightcast.client.weights import WeightsClient
    from weightcast.contract.layout import FUSED_WEIGHTS_FILE

    from vllm_helpers import Registry, llm_engine, qwen3_config, random_state

    config = qwen3_config(**SHAPES[name])
    registry = Registry(redis_url, f"bench-{name}", work / name)
    versions = [
        registry.publish(config, random_state(config, seed), layout="both") for seed in (1, 2)
    ]
    started = time.perf_counter()
    times: dict[str, list[float]] = {k: [] for k in ("swap", "stage", "apply", "read", "client")}
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
            began = time.perf_counter()
            swap(engine, version)
            times["swap"].append(time.perf_counter() - began)
            (worker,) = llm.collective_rpc(report)
            times["stage"].append(worker["stage_s"])
            times["apply"].append(worker["apply_s"])
            began = time.perf_counter()
            read_file(registry.versions[version] / FUSED_WEIGHTS_FILE)
            times["read"].append(time.perf_counter() - began)
            client = WeightsClient(  # a fresh client verifies again, as a worker does
                redis_url, registry.weights_dir, namespace=registry.namespace, node_id="bench"
            )
            began = time.perf_counter()
            client.rank_tensors(version, 0, 1)
            times["client"].append(time.perf_counter() - began)
        nbytes = worker["bytes"]
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"{name}: {nbytes / 1e6:.1f} MB; median swap {medians['swap']:.3f}s "
        f"(stage {medians['stage']:.3f}s, apply {medians['apply']:.3f}s); read the file "
        f"{medians['read']:.3f}s, client verify+read {medians['client']:.3f}s; "
        f"swap/read {medians['swap'] / medians['read']:.1f}x, "
        f"swap/client {medians['swap'] / medians['client']:.1f}x",
        flush=True,
    )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    from weightcast.local.redis_server import RedisServer

    with (
        tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp,
        RedisServer(Path(tmp) / "redis") as server,
    ):
        for name in args.shapes:
            bench_shape(name, args.runs, Path(tmp), server.url)


if __name__ == "__main__":
    main()
