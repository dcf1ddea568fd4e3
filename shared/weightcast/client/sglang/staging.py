"""Lease, verify and read a version for an SGLang engine, before SGLang sees any of it.

SGLang's loaders take whole Hugging Face tensors (each tensor-parallel rank narrows to its own
share), so an SGLang node reads versions of the ``hf`` layout. A version fused for vLLM, of
another model, quantized, or with a block that fails its digest is refused here, with the
reason and what to publish instead; nothing has reached the engine then.

Quantized (block-FP8) versions are refused whatever the engine: handed to a bf16 engine, the
FP8 tensors fail SGLang's loader inside its scheduler, which ends the engine and the node's
process with it; and an FP8 SGLang engine needs AMX tiles on a CPU (or a GPU), which no machine
this was built on had, so its update path is untested.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from weightcast.client.engine import REFUSED, VersionRefused, check_engine_model
from weightcast.client.weights import WeightsClient
from weightcast.contract.errors import WeightsError
from weightcast.contract.layout import LAYOUT_HF
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.version_info import VersionInfo


@dataclass(frozen=True)
class StagedVersion:
    """A version, verified and in host memory, not yet in the engine."""

    version: int
    tensors: dict[str, torch.Tensor]
    read_seconds: float
    via: str
    """``full``, ``delta`` or ``chain`` (rebuilt from the node's host base)."""
    read_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def quantization(config: dict[str, Any]) -> str:
    """The quantization a version's ``config.json`` declares (``fp8``), or ''."""
    declared = config.get("quantization_config")
    if declared is None:
        return ""
    method = declared.get("quant_method") if isinstance(declared, dict) else None
    return str(method or "quantization_config")


def stage(client: WeightsClient, info: VersionInfo, engine_shape: ModelShape) -> StagedVersion:
    """Read the version of ``info`` (leased by the caller) for an engine of ``engine_shape``,
    every block verified.

    Raises :class:`VersionRefused` for a version this engine must not load (the message says
    why and what to publish instead).
    """
    start = time.perf_counter()
    version = info.version
    try:
        manifest = client.manifest(info)
        if manifest.layout != LAYOUT_HF:
            raise WeightsError(
                f"version {version} is laid out for vLLM ({manifest.layout}, tp={manifest.tp}); "
                "SGLang loads whole HF tensors: publish with --layout hf"
            )
        config = client.config(info)
        if method := quantization(config):
            raise WeightsError(
                f"version {version} is quantized ({method}); weightcast's SGLang node loads "
                "bf16 versions only: publish without --quantize"
            )
        check_engine_model(config, info, engine_shape)
        tensors = client.load(info)
    except WeightsError as exc:
        raise VersionRefused(f"version {version} {REFUSED}: {type(exc).__name__}: {exc}") from exc
    stats = client.reader.stats
    return StagedVersion(version, tensors, time.perf_counter() - start, stats.via, stats.bytes_read)
