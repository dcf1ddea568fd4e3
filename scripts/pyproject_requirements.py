"""Print the requirements pyproject.toml names for an install with some extras, one a line.

The Dockerfile installs these before it copies the source, so that a source edit does not
reinstall the dependencies (`pip install .` needs the source; this needs only pyproject.toml).
Self-references such as ``weightcast[trainer,publisher]`` in an extra are expanded.

    python scripts/pyproject_requirements.py pyproject.toml trainer,publisher
    python scripts/pyproject_requirements.py pyproject.toml s3-server --extras-only

``--extras-only``: the extras' own requirements, without the core dependencies (an image
that runs only what an extra brings, such as s3.Dockerfile's ``weed``).
"""

import re
import sys
import tomllib


def requirements(project: dict, extras: list[str], core: bool = True) -> list[str]:
    """The core dependencies (unless ``core`` is false) plus those of ``extras``, in order,
    each once.

    An unknown extra is an error: a renamed extra must not leave an image without the
    dependencies it was meant to bring.
    """
    self_reference = re.compile(rf"{re.escape(project['name'])}\[([^\]]*)\]")
    optional = project.get("optional-dependencies", {})
    found = list(project.get("dependencies", [])) if core else []
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r}; it has {sorted(optional)}")
        seen.add(extra)
        for requirement in optional[extra]:
            nested = self_reference.fullmatch(requirement.replace(" ", ""))
            if nested:
                todo.extend(name for name in nested[1].split(",") if name)
            else:
                found.append(requirement)
    return list(dict.fromkeys(found))


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        project = tomllib.load(f)["project"]
    extras = [name for name in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if name]
    print("\n".join(requirements(project, extras, core="--extras-only" not in sys.argv[3:])))
