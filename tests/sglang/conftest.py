"""Fixtures of the SGLang tier: versions the real publisher wrote, what fresh SGLang engines
say of them, and the ``sgl_kernel`` stand-in's record of calls (asserted empty).

An SGLang engine starts in about 40 s on a 2-core CPU, so the versions and the fresh engines'
outputs are made once per session (the fresh engines one after another, in a process of their
own, before any engine under test starts), and each module shares one engine under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from weightcast.contract.model_shape import SHAPES
from weightcast.local.redis_server import RedisServer

from helpers.processes import with_test_modules
from helpers.registry import Registry, Versions, flip_byte, random_state
from sglang_helpers import STAND_IN, sglang_env

HERE = Path(__file__).resolve().parent
CALLS = Path(tempfile.mkdtemp(prefix="weightcast-sgl-kernel-")) / "calls"
"""Where the stand-in records a call, for every SGLang process of the session."""

os.environ.update(sglang_env(CALLS))
sys.path.insert(0, str(STAND_IN))  # this process imports SGLang too (the engines under test)

TINY = SHAPES["tiny"].to_hf_config()
ODD_VOCAB = replace(SHAPES["tiny"], vocab_size=1000).to_hf_config()
HF_WEIGHTS = "model-00001-of-00001.safetensors"
"""The weights file of a tiny ``hf`` version."""


def stand_in_calls() -> str:
    """What the stand-in recorded: one line per ``sgl_kernel`` function called."""
    return CALLS.read_text() if CALLS.exists() else ""


@pytest.fixture(scope="session", autouse=True)
def no_sgl_kernel_call() -> Iterator[None]:
    """No SGLang process of the session called the stand-in (checked after the last test)."""
    yield
    assert stand_in_calls() == "", f"SGLang called the sgl_kernel stand-in:\n{stand_in_calls()}"


@pytest.fixture(scope="session")
def registry(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Registry:
    return Registry(redis_server.url, "sg", tmp_path_factory.mktemp("registry"))


@pytest.fixture(scope="session")
def fresh_outputs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[list[Path]], dict[Path, Any]]:
    """``fresh_outputs(hf_dirs)``: what SGLang engines started from each directory generate
    (``fresh_engine.py``, in a process of its own; remembered for the session)."""
    known: dict[Path, Any] = {}

    def outputs(models: list[Path]) -> dict[Path, Any]:
        missing = [m for m in models if m not in known]
        if missing:
            out = tmp_path_factory.mktemp("fresh") / "outputs.json"
            subprocess.run(
                [sys.executable, str(HERE / "fresh_engine.py"), str(out), *map(str, missing)],
                env=with_test_modules(dict(os.environ)),
                check=True,
                timeout=900,
            )
            for model, result in json.loads(out.read_text()).items():
                known[Path(model)] = result
        return {m: known[m] for m in models}

    return outputs


@pytest.fixture(scope="session")
def tiny(registry: Registry) -> Versions:
    """A, B, C in the ``hf`` layout (C's delta is from B), versions the engine must refuse (B
    laid out for vLLM, another model, B with a corrupt block, B quantized to block-FP8), and
    B-norm: B with one tensor changed."""
    states = {name: random_state(TINY, seed) for seed, name in enumerate("ABC", start=1)}
    number = {name: registry.publish(TINY, states[name], layout="hf") for name in "ABC"}
    number["B-fused"] = registry.publish(TINY, states["B"])
    number["other-model"] = registry.publish(ODD_VOCAB, random_state(ODD_VOCAB, 9), layout="hf")
    number["B-corrupt"] = registry.publish(TINY, states["B"], layout="hf")
    flip_byte(registry.versions[number["B-corrupt"]] / HF_WEIGHTS)
    number["B-fp8"] = registry.publish(TINY, states["B"], layout="hf", quantize="fp8")
    norm = "model.norm.weight"
    states["B-norm"] = {**states["B"], norm: states["B"][norm] * 2}
    number["B-norm"] = registry.publish(TINY, states["B-norm"], layout="hf")
    return Versions(registry, number, states)


@pytest.fixture(scope="session")
def fresh(tiny: Versions, fresh_outputs: Any) -> dict[str, Any]:
    names = ["A", "B", "C", "B-norm"]
    by_dir = fresh_outputs([tiny.path(name) for name in names])
    return {name: by_dir[tiny.path(name)] for name in names}
