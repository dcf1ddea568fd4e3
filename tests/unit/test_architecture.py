"""The import rules of docs/architecture.md hold, checked by import-linter through
pyproject.toml's contracts, and the tool reports a breach; every module's file is where its
dotted name says, below one of the three source roots."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.files import REPO

ROOTS = ("shared", "trainer", "publisher")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_source_tree_keeps_the_import_rules() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout


def test_every_module_is_found_at_the_path_its_name_spells() -> None:
    checked = 0
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO / root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.origin == str(path), (name, spec)
            checked += 1
    assert checked > 80  # the walk found the tree


def test_the_module_map_links_every_module() -> None:
    """docs/architecture.md is the map a reader starts from: a module missing from it is a
    module nobody finds."""
    text = (REPO / "docs" / "architecture.md").read_text()
    modules = [
        path.relative_to(REPO).as_posix()
        for root in ROOTS
        for path in sorted((REPO / root).rglob("*.py"))
        if "__pycache__" not in path.parts
    ]
    assert len(modules) > 80
    assert [m for m in modules if f"(../{m})" not in text] == []


def test_an_upward_a_sideways_and_a_heavy_import_are_each_reported(tmp_path: Path) -> None:
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    for root in ROOTS:
        shutil.copytree(REPO / root, tmp_path / root, ignore=shutil.ignore_patterns("__pycache__"))
    breaches = {
        "shared/weightcast/contract/keys.py": "from weightcast.client import weights\n",
        "shared/weightcast/client/weights.py": "def f():\n    import transformers\n",
        "trainer/weightcast_trainer/worker.py": "import weightcast_publisher.daemon\n",
        "trainer/weightcast_trainer/settings.py": "def f():\n    import weightcast_trainer.job\n",
    }
    for path, line in breaches.items():
        with open(tmp_path / path, "a") as source:
            source.write(line)
    pythonpath = os.pathsep.join(str(tmp_path / root) for root in ROOTS)
    result = lint_imports(tmp_path, PYTHONPATH=pythonpath)
    report = result.stdout
    assert result.returncode == 1, report + result.stderr
    assert "Contracts: 0 kept, 3 broken." in report
    assert "weightcast.contract.keys -> weightcast.client.weights" in report
    assert "weightcast_trainer.worker -> weightcast_publisher.daemon" in report
    assert "weightcast.client.weights -> transformers" in report
    assert "weightcast_trainer.settings -> weightcast_trainer.job" in report  # then torchtitan


def test_no_module_imports_one_that_imports_it_back() -> None:
    """Cycles between modules (an import inside a function counts) hide which of the two is
    the lower one; none is left, so any new one is a mistake."""
    import grimp

    graph = grimp.build_graph("weightcast", "weightcast_trainer", "weightcast_publisher")
    cycles = sorted(
        (module, imported)
        for module in graph.modules
        for imported in graph.find_modules_directly_imported_by(module)
        if imported != module and graph.find_shortest_chain(imported, module)
    )
    assert not cycles, cycles
