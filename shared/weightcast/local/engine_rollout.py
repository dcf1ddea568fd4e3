"""What the rollout nodes on a real engine share (``up --engine vllm`` and ``--engine sglang``):
the engine's own venv, the machine's CPU flags, and the refresh that keeps the engine on the
newest version. Each engine's module (:mod:`~weightcast.local.vllm_rollout`,
:mod:`~weightcast.local.sglang_rollout`) keeps to that engine's calls."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from weightcast.client.engine import EngineError
from weightcast.client.node import Node
from weightcast.contract.errors import ConfigError, VersionGone, WeightsError
from weightcast.contract.model_shape import ModelShape
from weightcast.local.policy import Policy
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger

log = get_logger("rollout")

HF_ARCHITECTURE = "Qwen3ForCausalLM"
"""What the engines build: a version's own config may name weightcast's fused architecture,
which stock engines refuse on purpose; the engine is built as the plain model it is."""


class EnginePolicy:
    """A :class:`Policy` that samples from an engine (``engine``), which serves ``version``."""

    def __init__(self, engine: Any, version: int, vocab_size: int) -> None:
        self.engine = engine
        self.version = version
        self.vocab_size = vocab_size


class EnginePolicies:
    """``refresh`` for :class:`~weightcast.local.rollout.RolloutLoop`: the engine on the newest
    version, started at the first one. Subclasses start the engine, load a version into it
    and wrap it as a :class:`Policy`."""

    engine_name = ""
    """The engine's module (``vllm``, ``sglang``), also its name in logs."""
    engine_label = ""
    """Its name in messages (``vLLM``, ``SGLang``)."""
    venv_python = Path()
    """The venv's Python that ``make <setup>`` builds in a checkout."""
    setup = ""
    """That make target (``vllm-setup``)."""

    def __init__(self, config: Config, node: Node) -> None:
        try:
            importlib.import_module(self.engine_name)
        except ImportError:
            raise ConfigError(
                f"rollout.engine = {self.engine_name} needs {self.engine_label}, which this "
                f"Python ({sys.executable}) lacks: run `make {self.setup}` and use "
                f"{self.venv_python}"
            ) from None
        self.config = config
        self.node = node
        self.started = False
        self.vocab_size = 0
        self.model_dir = tempfile.TemporaryDirectory(prefix=f"weightcast-{self.engine_name}-")
        """Holds the engine's ``config.json``; removed when the node exits."""

    def engine_model(self, version: int) -> tuple[Path, dict[str, Any], ModelShape]:
        """The directory an engine of ``version``'s model starts from (its ``config.json``,
        the plain architecture's), that config and the model's shape; sets
        :attr:`vocab_size`."""
        with self.node.client.lease(version) as info:
            config = self.node.client.config(info)
        shape = ModelShape.from_hf_config(config)
        self.vocab_size = shape.vocab_size
        model = Path(self.model_dir.name)
        (model / "config.json").write_text(
            json.dumps({**config, "architectures": [HF_ARCHITECTURE]})
        )
        return model, config, shape

    def start_engine(self, version: int) -> None:
        raise NotImplementedError

    def load(self, version: int) -> None:
        raise NotImplementedError

    def policy(self, version: int) -> Policy:
        raise NotImplementedError

    def refresh(self, policy: Policy) -> Policy | None:
        """The engine on the newest version if it is newer than ``policy``'s, else None."""
        latest = self.node.client.latest()
        if latest <= max(policy.version, self.node.seen):
            return None
        try:
            if not self.started:
                self.start_engine(latest)
                self.started = True
            self.load(latest)
        except (EngineError, WeightsError, VersionGone) as exc:
            if not isinstance(exc, VersionGone):  # evicted meanwhile: the next one may do
                self.node.seen = latest
            log.error(
                f"the {self.engine_name} engine did not load version",
                version=latest,
                error=str(exc),
            )
            return None
        self.node.client.report_loaded(latest)
        self.node.current = self.node.seen = latest
        log.info(f"{self.engine_name} engine serves version", version=latest)
        return self.policy(latest)


def cpu_flags() -> set[str]:
    """The flags of the first processor in ``/proc/cpuinfo`` (none where it is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def gpu_here() -> bool:
    """An NVIDIA GPU on this machine (its control device)."""
    return Path("/dev/nvidiactl").exists()


def fp8_refusal(engine: str, why: str, flags: set[str], gpu: bool) -> str | None:
    """Why ``up --engine <engine> --quantize fp8`` cannot run here (``why``: the engine's CPU
    FP8 layers need AMX tiles), or None: a CPU with them, or a GPU."""
    if gpu or "amx_tile" in flags:
        return None
    return (
        f"--quantize fp8 with --engine {engine}: {why} (no amx_tile in /proc/cpuinfo) and no "
        "GPU is here; use --engine transformers, which samples with the FP8 versions' "
        "dequantized weights"
    )


def engine_python(engine: str, setting: str, venv_python: Path, setup: str, flag: str) -> str:
    """The Python for ``up --engine <engine>``'s rollout node (``setting``, else the venv
    ``make <setup>`` builds); ConfigError unless it imports ``engine`` and weightcast."""
    python = Path(setting) if setting else venv_python
    name = "up." + flag.removeprefix("--").replace("-", "_")
    if not python.is_file():
        raise ConfigError(
            f"--engine {engine} needs a Python with {engine}: {python} does not exist. Run "
            f"`make {setup}` (builds {venv_python.parts[0]}), or set {name} ({flag})"
        )
    probe = (  # a module, not a namespace package (a folder named like it in the cwd)
        "import importlib.util as u, sys; sys.exit(not all(getattr(u.find_spec(m), 'origin', "
        f"None) for m in ({engine!r}, 'weightcast')))"
    )
    if subprocess.run([str(python), "-c", probe], capture_output=True).returncode:
        raise ConfigError(
            f"--engine {engine}: {python} cannot import {engine} and weightcast; run "
            f"`make {setup}` or point {name} ({flag}) at a Python that has both"
        )
    return str(python.absolute())
