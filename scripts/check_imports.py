"""Check weightcast's import rules (docs/architecture.md); ``make lint`` runs it.

The rules live in ``pyproject.toml`` under ``[tool.weightcast.imports]``:

* ``layers``: rows from the top (the CLI) to the bottom (the contract). A module may import
  its own package and the rows below its own; the packages of one row are independent of
  each other. ``weightcast`` itself (the public API) and every ``__main__`` entry point are
  above every row.
* ``core`` packages (what ``pip install weightcast`` gives) must not import any of
  ``core_forbidden`` (the trainer's, publisher's and demo's dependencies).
* Nothing names the folders as modules: no ``shared.x`` / ``trainer.x`` / ``publisher.x``
  module paths in code, tests, docs or configs (``-m trainer``, ``"trainer.loss:fn"``...).

Modules are found through ``[tool.setuptools] package-dir``, so the check reads the source
tree as installed (import-linter cannot: ``weightcast.trainer`` lives outside ``shared/``).
Exit status 1 lists every violation.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("shared", "trainer", "publisher")
TEXT_FILES = ("*.md", "*.toml", "*.yaml", "*.yml", "*.sh", "Makefile", "Dockerfile", "*.cfg")
_BARE_MODULE = re.compile(r"(?:-m\s+|--worker-extension-cls[\s=]+)(shared|trainer|publisher)\b")
_BARE_PLUGIN = re.compile(r"\b(shared|trainer|publisher)(\.\w+)+:\w+")


@dataclass(frozen=True)
class Rules:
    layers: list[list[str]]
    core: list[str]
    core_forbidden: list[str]
    package_dir: dict[str, Path]


def load_rules(root: Path = ROOT) -> Rules:
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    rules = pyproject["tool"]["weightcast"]["imports"]
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    return Rules(
        rules["layers"],
        rules["core"],
        rules["core_forbidden"],
        {name: root / folder for name, folder in package_dir.items()},
    )


def modules(rules: Rules) -> dict[str, Path]:
    """Every module of the package, by dotted name, with its file."""
    found: dict[str, Path] = {}
    for package, folder in rules.package_dir.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            owner = max((p for p in rules.package_dir if name.startswith(p)), key=len)
            if owner == package:  # a subpackage mapped elsewhere owns its own files
                found[name] = path
    return found


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every absolute import in ``path``, lazy ones included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module


def _row(layers: list[list[str]], module: str) -> tuple[int, str] | None:
    """The layer row and package a module belongs to (None: the top-level package)."""
    for index, row in enumerate(layers):
        for package in row:
            if module == package or module.startswith(package + "."):
                return index, package
    return None


def check_layers(rules: Rules, found: dict[str, Path], root: Path = ROOT) -> list[str]:
    """Every import that goes up a layer, sideways in a row, or out of the core install."""
    problems = []
    for module, path in found.items():
        source = _row(rules.layers, module)
        if source is None or module.endswith(".__main__"):  # entry points sit above all
            continue
        core = any(module == p or module.startswith(p + ".") for p in rules.core)
        for line, target in imports(path):
            where = f"{path.relative_to(root)}:{line}"
            top = target.split(".")[0]
            if core and top in rules.core_forbidden:
                problems.append(f"{where}: {module} (core install) imports {target}")
            if top != "weightcast":
                continue
            destination = _row(rules.layers, target)
            if destination is None:
                if target != "weightcast":
                    problems.append(f"{where}: {module} imports {target}, outside every layer")
                continue
            if destination[0] < source[0] or (
                destination[0] == source[0] and destination[1] != source[1]
            ):
                problems.append(
                    f"{where}: {module} imports {target}: "
                    f"{source[1]} may not depend on {destination[1]}"
                )
    return problems


def _string_paths(path: Path, module_names: set[str]) -> Iterator[tuple[int, str]]:
    """String literals that spell a module of the folders by its folder name."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.split(":")[0]
            if text.split(".")[0] in FOLDERS and text in module_names:
                yield node.lineno, node.value


def check_names(rules: Rules, found: dict[str, Path]) -> list[str]:
    """No module path that names a folder instead of the package (``shared.x``, ``-m trainer``)."""
    bare = set()
    for name in found:
        for package, folder in rules.package_dir.items():
            if name.startswith(package):
                bare.add(".".join([folder.name, *name[len(package) :].split(".")[1:]]))
    # Setting names such as ``trainer.loss`` are not module paths.
    bare -= {"trainer", "publisher", "shared"} | _setting_names()
    problems = []
    files = _project_files()
    for path in (p for p in files if p.suffix == ".py"):
        for line, value in _string_paths(path, bare):
            problems.append(f"{path.relative_to(ROOT)}:{line}: module path {value!r}")
    for pattern in TEXT_FILES:
        for path in (p for p in files if p.match(pattern)):
            for line_no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for regex in (_BARE_MODULE, _BARE_PLUGIN):
                    if match := regex.search(line):
                        problems.append(
                            f"{path.relative_to(ROOT)}:{line_no}: module path {match.group(0)!r}"
                        )
    return problems


def _setting_names() -> set[str]:
    """``trainer.<field>`` and the like, read from the config dataclasses' source."""
    tree = ast.parse((ROOT / "shared" / "runtime" / "config.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
            section = node.name.removesuffix("Config").lower()
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(f"{section}.{item.target.id}")
    return names


def _project_files() -> list[Path]:
    """The repository's files, without hidden folders (.venv, .git) and build output."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "build")
        found += [Path(folder) / name for name in sorted(files)]
    return found


def main() -> int:
    rules = load_rules()
    found = modules(rules)
    problems = check_layers(rules, found) + check_names(rules, found)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} import rule violation(s); see docs/architecture.md")
        return 1
    print(f"import rules hold for {len(found)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
