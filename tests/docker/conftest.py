"""Fixtures for tests/docker: see compose_harness.py. The engine's are module-scoped: a
dockerd started for the stack test stops when that module is done, not after the whole suite."""

from __future__ import annotations

import os
from collections.abc import Iterator

import compose_harness
import pytest
from compose_harness import Engine


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with compose_harness.docker_engine() as running:
        yield running


@pytest.fixture(scope="module")
def base_images(engine: Engine) -> dict[str, str]:
    return compose_harness.base_images(engine)


@pytest.fixture(scope="module")
def torch_build_args(engine: Engine) -> Iterator[dict[str, str]]:
    with compose_harness.torch_build_args() as args:
        yield args


@pytest.fixture(scope="session")
def compose_cli() -> list[str]:
    """Compose v2 for `config` (no engine needed)."""
    if os.environ.get("WEIGHTCAST_DOCKER_TEST") == "0":
        pytest.skip("WEIGHTCAST_DOCKER_TEST=0")
    compose_harness.STATE.mkdir(parents=True, exist_ok=True)
    return compose_harness.compose_command(compose_harness.docker_cli())
