"""The import rules of docs/architecture.md hold, and their checker catches a breach."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from helpers import REPO

spec = importlib.util.spec_from_file_location("check_imports", REPO / "scripts/check_imports.py")
assert spec is not None and spec.loader is not None
check_imports = importlib.util.module_from_spec(spec)
sys.modules["check_imports"] = check_imports
spec.loader.exec_module(check_imports)


def test_the_source_tree_keeps_the_import_rules() -> None:
    rules = check_imports.load_rules()
    found = check_imports.modules(rules)
    assert "weightcast.trainer.worker" in found and "weightcast.contract.keys" in found
    assert check_imports.check_layers(rules, found) == []
    assert check_imports.check_names(rules, found) == []


def test_an_upward_a_sideways_and_a_heavy_import_are_each_reported(tmp_path: Path) -> None:
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    for folder in ("shared/contract", "shared/client", "trainer", "publisher"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / "shared/contract/keys.py").write_text("from weightcast.client import weights\n")
    (tmp_path / "shared/client/weights.py").write_text("def f():\n    import transformers\n")
    (tmp_path / "trainer/worker.py").write_text("import weightcast.publisher.daemon\n")
    (tmp_path / "publisher/daemon.py").write_text("from weightcast.contract import keys\n")
    rules = check_imports.load_rules(tmp_path)
    found = check_imports.modules(rules)
    assert set(found) == {
        "weightcast.contract.keys",
        "weightcast.client.weights",
        "weightcast.trainer.worker",
        "weightcast.publisher.daemon",
    }
    problems = "\n".join(check_imports.check_layers(rules, found, tmp_path))
    assert "weightcast.contract may not depend on weightcast.client" in problems
    assert "weightcast.trainer may not depend on weightcast.publisher" in problems
    assert "(core install) imports transformers" in problems
    assert "publisher/daemon.py" not in problems
