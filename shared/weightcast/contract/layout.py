"""The layouts a version may have and the names of their files.

``vllm-fused`` (the default) holds vLLM's fused tensors (:mod:`weightcast.contract.fusion`)
in ``model.vllm-fused``, or one file per tensor-parallel rank; ``hf`` the HF tensors as they
are; ``both`` the fused files and the HF ones under ``hf/``. How each tensor is split over
ranks is :mod:`weightcast.contract.sharding`; which bytes make each file is
:mod:`weightcast.contract.plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LAYOUT_VLLM_FUSED = "vllm-fused"
LAYOUT_HF = "hf"
LAYOUT_BOTH = "both"
LAYOUTS = (LAYOUT_VLLM_FUSED, LAYOUT_HF, LAYOUT_BOTH)
HF_DIR = "hf"
"""Where ``both`` puts the HF layout, inside the version directory."""

# Stock vLLM must refuse a fused version, not load it wrong: its ``load_weights`` accepts the
# fused names and splits ``qkv_proj`` / ``gate_up_proj`` as one HF concatenation, which is
# right only at tp=1. Two markers make every stock path fail loudly:
FUSED_ARCHITECTURE = "WeightcastFusedQwen3ForCausalLM"
"""The ``architectures`` of a fused version's ``config.json``: no stock vLLM (or transformers)
model class has this name, so ``LLM(model=<version>)`` and ``vllm serve <version>`` stop at
once. ``model_type`` stays ``qwen3``, and weightcast's readers compare shapes, not names."""
FUSED_FILE_SUFFIX = ".vllm-fused"
"""Fused weight files end in this, not ``.safetensors`` (they are safetensors inside): vLLM's
default loader, which ``reload_weights(weights_path=...)`` uses and which never reads
``config.json``, globs ``*.safetensors`` / ``*.bin`` / ``*.pt`` and so finds no weights.
weightcast's readers take file names from the manifest."""
FUSED_WEIGHTS_FILE = f"model{FUSED_FILE_SUFFIX}"


def fused_rank_file(rank: int, tp: int) -> str:
    """The file of tp rank ``rank`` in a version with per-rank files."""
    return f"model-rank-{rank:02d}-of-{tp:02d}{FUSED_FILE_SUFFIX}"


def fused_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` written beside fused weights: the model's, with the marker
    architecture (see :data:`FUSED_ARCHITECTURE`)."""
    return {**config, "architectures": [FUSED_ARCHITECTURE]}


def hf_file_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"
