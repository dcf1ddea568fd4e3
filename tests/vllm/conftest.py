"""Fixtures of the vLLM tier: versions the real publisher wrote, and what fresh engines say.

Engines start slowly on CPU (a minute or more on a loaded 2-core machine), so the versions
and the fresh engines' outputs are made once per session and shared; the engines under test
are module fixtures, brought to a known version by each test (an update takes milliseconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from weightcast.client.engine import REFUSED, EngineError
from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.local_engine import LocalEngine
from weightcast.contract.layout import FUSED_WEIGHTS_FILE, fused_rank_file
from weightcast.contract.manifest import MANIFEST_NAME, sha256_bytes
from weightcast.local.redis_server import RedisServer

from helpers.processes import with_test_modules
from helpers.registry import Versions, flip_byte
from vllm_helpers import ODD_VOCAB, TINY, Registry, greedy, random_state

HERE = Path(__file__).resolve().parent


def tp_env(tp: int) -> dict[str, str]:
    """Environment for a CPU engine at ``tp``: one core, so one thread, per rank. vLLM's
    automatic binding wants a NUMA node per rank, which a small machine does not have, and at
    tp 1 gives its worker every core but one, where a fresh reference (``fresh_engine.py``)
    runs with the threads it is given. A different thread count sums in another order: on an
    AVX-512 Xeon a 0.6B engine's log-probabilities then differ in their last bits, and now
    and then a greedy token (seen on an Intel Xeon; an AMD EPYC happened to agree)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tp)))}


os.environ.update(tp_env(1))  # every tp-1 engine of the tier: LLMs here, `vllm serve`, `up`


def shard_norm_as_qkv(registry: Registry, version: int) -> None:
    """The issue-19 version: ``model.norm.weight`` described as a qkv tensor of 4096 rows a
    rank, the manifest's SHA-256 registered anew (whoever can write Redis can do this)."""
    directory = registry.versions[version]
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    norm = next(t for t in manifest["tensors"] if t["name"] == "model.norm.weight")
    norm["shard"] = {
        "kind": "qkv",
        "dim": 0,
        "tp": 1,
        "rank_rows": 4096,
        "q_rows": 4094,
        "kv_rows": 1,
    }
    text = json.dumps(manifest).encode()
    (directory / MANIFEST_NAME).write_bytes(text)
    client = redis.Redis.from_url(registry.redis_url)
    client.hset(registry.keys.version(version), "manifest_sha256", sha256_bytes(text))
    client.close()


def assert_refused_and_unchanged(
    engine: LocalEngine, versions: Versions, fresh: dict[str, Any], bad: str, reason: str
) -> None:
    """``bad`` is refused with ``reason`` while the engine serves B, which it still serves,
    exactly, and still reports; then C and B load again (the engine is in sync)."""
    swap(engine, versions.number["B"])
    with pytest.raises(EngineError, match=f"{REFUSED}: {reason}"):
        swap(engine, versions.number[bad])
    assert greedy(engine.llm) == fresh["B"]
    assert engine.weight_version() == str(versions.number["B"])
    for name in "CB":  # every later call gets its own reply: nothing was left queued
        swap(engine, versions.number[name])
        assert greedy(engine.llm) == fresh[name]


@pytest.fixture(scope="session")
def registry(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Registry:
    return Registry(redis_server.url, "vt", tmp_path_factory.mktemp("registry"))


@pytest.fixture(scope="session")
def tiny(registry: Registry) -> Versions:
    """The tiny model for a tp=1 engine: A, B, C as ``both`` (fused + ``hf/``), A again as
    ``hf``, and versions the engine must refuse."""
    states = {name: random_state(TINY, seed) for seed, name in enumerate("ABC", start=1)}
    number = {name: registry.publish(TINY, states[name], layout="both") for name in "ABC"}
    number["A-hf"] = registry.publish(TINY, states["A"], layout="hf")
    number["B-tp2"] = registry.publish(TINY, states["B"], tp=2)
    number["other-model"] = registry.publish(ODD_VOCAB, random_state(ODD_VOCAB, 9))
    number["B-corrupt"] = registry.publish(TINY, states["B"])
    flip_byte(registry.versions[number["B-corrupt"]] / FUSED_WEIGHTS_FILE)
    number["B-norm-as-qkv"] = registry.publish(TINY, states["B"])
    shard_norm_as_qkv(registry, number["B-norm-as-qkv"])
    return Versions(registry, number, states)


@pytest.fixture(scope="session")
def odd(registry: Registry) -> Versions:
    """The odd-vocabulary model for a tp=2 engine: A', B' (one fused file) and C' (per-rank
    files), all ``both``; B' fused for tp=1, and C' with rank 1's file corrupted."""
    states = {name: random_state(ODD_VOCAB, seed) for seed, name in enumerate("ABC", start=11)}
    number = {name: registry.publish(ODD_VOCAB, states[name], tp=2, layout="both") for name in "AB"}
    number["C"] = registry.publish(ODD_VOCAB, states["C"], tp=2, layout="both", per_rank_files=True)
    number["B-tp1"] = registry.publish(ODD_VOCAB, states["B"])
    number["C-rank1-corrupt"] = registry.publish(ODD_VOCAB, states["C"], tp=2, per_rank_files=True)
    flip_byte(registry.versions[number["C-rank1-corrupt"]] / fused_rank_file(1, 2))
    return Versions(registry, number, states)


@pytest.fixture(scope="session")
def fresh_outputs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[int, list[Path]], dict[Path, Any]]:
    """``fresh_outputs(tp, hf_dirs)``: what stock engines started from each directory
    generate (``fresh_engine.py``, in a process of its own; remembered for the session)."""
    known: dict[tuple[int, Path], Any] = {}

    def outputs(tp: int, models: list[Path]) -> dict[Path, Any]:
        missing = [m for m in models if (tp, m) not in known]
        if missing:
            out = tmp_path_factory.mktemp("fresh") / "outputs.json"
            script = str(HERE / "fresh_engine.py")
            subprocess.run(
                [sys.executable, script, str(out), str(tp), *map(str, missing)],
                env=with_test_modules({**os.environ, **tp_env(tp)}),
                check=True,
                timeout=1200,
            )
            for model, result in json.loads(out.read_text()).items():
                known[(tp, Path(model))] = result
        return {m: known[(tp, m)] for m in models}

    return outputs


@pytest.fixture(scope="module")
def bind_tp2() -> Iterator[None]:
    """Set the tp=2 CPU binding while a module's tp=2 engines start."""
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ.update(tp_env(2))
    yield
    if saved is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
