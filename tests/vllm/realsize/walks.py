"""The real-size walk (``helpers.realsize.WALK``) through a vLLM engine with the weightcast
backend, held after every update to what a fresh stock engine of that version generates."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from weightcast.client.engine import REFUSED as REFUSED_REPLY
from weightcast.client.engine import EngineError
from weightcast.client.vllm.engine import swap
from weightcast.client.vllm.local_engine import LocalEngine

from helpers.realsize import REFUSED, SERVED, WALK, RealSizeVersions
from vllm_helpers import Registry, greedy

FreshOutputs = Callable[[int, list[Path]], dict[Path, Any]]


def fresh_of(versions: RealSizeVersions, fresh_outputs: FreshOutputs, tp: int) -> dict[int, Any]:
    """What fresh stock engines at ``tp`` started from each served version generate."""
    by_dir = fresh_outputs(tp, [versions.hf_dirs[v] for v in SERVED])
    return {v: by_dir[versions.hf_dirs[v]] for v in SERVED}


def registry_of(versions: RealSizeVersions) -> Registry:
    """The registry of the versions, as the engine helpers take it."""
    deployment = versions.deployment
    return Registry(deployment.redis_url, deployment.keys.namespace, deployment.root)


def walk(engine: LocalEngine, fresh: dict[int, Any], tp: int = 1) -> None:
    """Take ``engine`` through :data:`WALK`: after every update each of its ``tp`` workers
    took the version the way the step says, the engine reports it, and generates what
    ``fresh`` (:func:`fresh_of`) says that version's fresh engine generates; a refused
    version leaves it serving the one before.

    At tp > 1 a rank reads only its part: after the corrupt version, a rank whose own part
    of it passed every digest keeps that part as its base and takes the next version by its
    delta (verified like any), while the rank that met the flipped byte reads it whole."""
    from weightcast.client.vllm.backend import report

    held, refused_before = 0, False
    for step in WALK:
        if step.via == REFUSED:
            with pytest.raises(EngineError, match=REFUSED_REPLY):
                swap(engine, step.version)
        else:
            swap(engine, step.version)
            held = step.version
            reports = engine.llm.collective_rpc(report)
            assert [r["rank"] for r in reports] == list(range(tp)), reports
            assert {r["version"] for r in reports} == {held}, (step, reports)
            vias = {r["via"] for r in reports}
            allowed = {step.via, "delta"} if refused_before and tp > 1 else {step.via}
            assert step.via in vias and vias <= allowed, (step, vias)
        refused_before = step.via == REFUSED
        assert engine.weight_version() == str(held)
        assert greedy(engine.llm) == fresh[held], step


def point_at(engine: LocalEngine, versions: RealSizeVersions, node_id: str, where: str) -> None:
    """Initialise the engine's backend to read ``versions`` from the ``bucket`` or the
    ``directory``: its next update reads through a new reader (no base)."""
    location = registry_of(versions).location(node_id)
    if where == "bucket":
        location["weights_root"] = versions.deployment.location
    engine.init_weight_transfer_engine(location)
