"""``python -m bench``'s list is the scripts of ``bench/``: every script has a name there and
every name a script, so no benchmark is missing from the one entry point."""

from __future__ import annotations

import importlib.util

from helpers.files import REPO

LIBRARIES = {"common.py", "__main__.py"}
"""The files of ``bench/`` that are not benchmarks."""


def bench_main():
    spec = importlib.util.spec_from_file_location("bench_main", REPO / "bench" / "__main__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_script_of_bench_has_a_name_and_every_name_a_script() -> None:
    listed = {script for script, _ in bench_main().BENCHMARKS.values()}
    scripts = {p.name for p in (REPO / "bench").glob("*.py")} - LIBRARIES
    assert listed == scripts


def test_the_usage_lists_every_name() -> None:
    main = bench_main()
    usage = main.usage()
    assert usage.startswith("usage: python -m bench NAME [ARGS]")
    for name in main.BENCHMARKS:
        assert f"  {name} " in usage
