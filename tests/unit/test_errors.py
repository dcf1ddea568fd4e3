"""One error tree: what weightcast raises across modules is a ``WeightcastError``, and whether
vLLM refused a version is a type."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from weightcast.client.vllm.driver import EngineError, VersionRefused, engine_error
from weightcast.client.vllm.protocol import REFUSED
from weightcast.contract.errors import WeightcastError

PACKAGES = ("weightcast", "weightcast_trainer", "weightcast_publisher")


def exception_classes() -> list[type[BaseException]]:
    """Every exception class the three packages define (the vLLM backend only where vLLM is
    installed: it runs inside vLLM's workers)."""
    found = []
    for root in PACKAGES:
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, f"{root}."):
            try:
                module = importlib.import_module(info.name)
            except ModuleNotFoundError as exc:
                if (exc.name or "").partition(".")[0] == "vllm":
                    continue
                raise
            found += [
                value
                for value in vars(module).values()
                if inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ]
    return found


def test_every_error_weightcast_defines_is_a_weightcast_error() -> None:
    classes = exception_classes()
    assert len(classes) > 20  # the walk found the tree
    assert [c.__qualname__ for c in classes if not issubclass(c, WeightcastError)] == []


def test_a_refused_version_is_told_from_an_engine_failure_by_its_type() -> None:
    refused = engine_error(f"POST /update_weights: HTTP 500: version 3 {REFUSED}: bad shape")
    failed = engine_error("POST /update_weights: HTTP 500: CUDA out of memory")
    assert isinstance(refused, VersionRefused)
    assert type(failed) is EngineError
