"""The light client install: ``pip install weightcast`` (no extras) in a venv of its own.

An inference node or a rollout producer installs only the core: redis, safetensors, xxhash,
numpy, zstandard and torch. The venv is built from a wheel of this checkout (the main venv is
an editable install, so both kinds are exercised); it is reused while pyproject.toml is
unchanged.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import redis
import torch
from packaging.requirements import Requirement

from weightcast.contract.keys import Keys
from weightcast.local.redis_server import RedisServer

from helpers.files import REPO
from helpers.versions import Deployment

CORE_VENV = REPO / ".venv-core"
TORCH_SPEC = os.environ.get("TORCH_SPEC", f"torch=={torch.__version__.split('+')[0]}")

NODE_SCRIPT = """
import json, sys
import torch
import weightcast
from weightcast import AsyncWeightsClient, BatchProducer, AsyncBatchProducer, WeightsClient
import weightcast.client.vllm.server_node  # the vLLM node needs neither vLLM nor the trainer

missing = []
for heavy in ("torchtitan", "watchdog", "transformers", "prometheus_client"):
    try:
        __import__(heavy)
    except ImportError:
        missing.append(heavy)
redis_url, namespace, root, version = sys.argv[1:5]
client = WeightsClient(redis_url, root, namespace=namespace, node_id="core-node")
with client.lease(int(version)) as info:
    tensors = client.load(info)
client.report_loaded(int(version))
print(json.dumps({
    "package": weightcast.__file__,
    "torch": torch.__version__,
    "missing": missing,
    "tensors": {name: [list(t.shape), str(t.dtype), float(t.float().sum())]
                for name, t in tensors.items()},
}))
"""


def _fingerprint() -> str:
    return hashlib.sha256((REPO / "pyproject.toml").read_bytes() + TORCH_SPEC.encode()).hexdigest()


def build_wheel(out: Path) -> Path:
    """A wheel of this checkout, built the way pip builds it for a user."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = out.glob("weightcast-*.whl")
    return wheel


def holds_torch_spec(python: Path) -> bool:
    """Whether the venv of ``python`` holds a torch that :data:`TORCH_SPEC` allows."""
    done = subprocess.run(
        [str(python), "-c", "from importlib.metadata import version; print(version('torch'))"],
        capture_output=True,
        text=True,
    )
    return done.returncode == 0 and Requirement(TORCH_SPEC).specifier.contains(done.stdout.strip())


def core_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The core venv's python, built (under a lock) from a fresh wheel of this checkout.

    The wheel goes in twice: with its dependencies, which keeps the torch of
    :data:`TORCH_SPEC` (``--force-reinstall`` alone reinstalled every dependency, and
    ``torch>=2.6`` became PyPI's newest, a CUDA build with 3 GB of NVIDIA libraries), then
    ``--no-deps --force-reinstall``: this checkout's code over a same-numbered install."""
    python = CORE_VENV / "bin" / "python"
    stamp = CORE_VENV / ".fingerprint"
    with open(REPO / ".venv-core.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pip = [str(python), "-m", "pip", "install", "-q"]
        reusable = python.exists() and stamp.exists() and stamp.read_text() == _fingerprint()
        if not (reusable and holds_torch_spec(python)):
            shutil.rmtree(CORE_VENV, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(CORE_VENV)], check=True)
            subprocess.run([*pip, TORCH_SPEC], check=True, timeout=900)
            stamp.write_text("")
        wheel = str(build_wheel(tmp_path_factory.mktemp("wheel")))
        subprocess.run([*pip, wheel], check=True, timeout=900)
        subprocess.run([*pip, "--no-deps", "--force-reinstall", wheel], check=True, timeout=300)
        stamp.write_text(_fingerprint())
    return python


def test_the_wheel_holds_the_three_packages_by_role(tmp_path: Path) -> None:
    wheel = zipfile.ZipFile(build_wheel(tmp_path))
    names = wheel.namelist()
    assert "weightcast_trainer/worker.py" in names
    assert "weightcast_publisher/daemon.py" in names
    assert "weightcast/contract/keys.py" in names and "weightcast/py.typed" in names
    tops = {name.split("/")[0] for name in names if not name.startswith("weightcast-")}
    expected = {"weightcast", "weightcast_trainer", "weightcast_publisher"}
    assert tops == expected, f"the wheel installs other top-level names: {tops - expected}"
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [
        line.split(":", 1)[1].strip()
        for line in wheel.read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert sorted(r.split(">")[0].split("=")[0].split("<")[0] for r in requires) == [
        "boto3",
        "numba",
        "numpy",
        "redis",
        "safetensors",
        "torch",
        "xxhash",
        "zstandard",
    ]
    assert not any("<" in r for r in requires if r.startswith("torch")), "torch is capped"


def test_a_core_install_loads_a_version_the_full_install_published(
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    client: redis.Redis,
    keys: Keys,
    redis_server: RedisServer,
) -> None:
    python = core_python(tmp_path_factory)
    deployment = Deployment(client, keys, tmp_path, redis_server.url)
    version = deployment.publish()
    expected = deployment.reader().load(version)
    # Run from the repository root, whose folder shared/ must not shadow the package.
    result = subprocess.run(
        [
            str(python),
            "-c",
            NODE_SCRIPT,
            redis_server.url,
            keys.namespace,
            str(tmp_path / "weights"),
            str(version),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert Path(report["package"]).is_relative_to(CORE_VENV), report["package"]
    assert Requirement(TORCH_SPEC).specifier.contains(report["torch"]), report["torch"]
    assert report["missing"] == ["torchtitan", "watchdog", "transformers", "prometheus_client"]
    assert report["tensors"] == {
        name: [list(t.shape), str(t.dtype), float(t.float().sum())] for name, t in expected.items()
    }
    assert json.loads(client.hget(keys.nodes, "core-node"))["version"] == version
