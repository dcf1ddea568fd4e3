"""FP8 versions per rank against vLLM's own Qwen3 with block-FP8 parameters, dense at tp 1,
2 and 4 (4 > the 2 kv heads: replicated), one process per rank over gloo (``fp8_ranks.py``,
whose doc says why the parameters are made by vLLM's functions rather than by its kernel
choice, which needs AMX). The truth is stock ``load_weights`` of a checkpoint quantized by
vLLM's ``per_block_cast_to_fp8`` from the same bf16 weights; what the backend stages for each
rank from versions the real publisher wrote (one fused file; per-rank files) must be it, bit
for bit, every weight and every scale; so must a fresh model after stock ``load_weights`` of
what the backend's placement hands it (its layerwise mode), from those and from the ``hf``
layout. MoE at tp 2 and ep 2 too.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from weightcast.contract.model_shape import SHAPES

from vllm_helpers import FP8_MODEL, Registry, random_state, run_ranks

FP8_MOE = replace(
    SHAPES["tiny-moe"],
    hidden_size=256,
    intermediate_size=256,
    num_heads=2,
    num_kv_heads=2,
    head_dim=128,
    vocab_size=1000,
    num_experts=4,
    moe_intermediate_size=256,
    mlp_only_layers=(1,),
).to_hf_config()
"""A Qwen3-MoE (a dense layer among sparse ones) whose experts' 256 rows are 128 per rank
at tp 2."""


CASES = {
    "dense tp 1": (FP8_MODEL, 1, False),
    "dense tp 2": (FP8_MODEL, 2, False),
    "dense tp 4": (FP8_MODEL, 4, False),
    "moe tp 2": (FP8_MOE, 2, False),
    "moe ep 2": (FP8_MOE, 2, True),
}


@pytest.mark.parametrize(("config", "tp", "ep"), CASES.values(), ids=CASES.keys())
def test_every_rank_stages_exactly_what_vllm_loads_from_an_fp8_checkpoint(
    config: dict[str, Any], tp: int, ep: bool, registry: Registry, tmp_path: Path
) -> None:
    state = random_state(config, 31)
    path = tmp_path / "state.safetensors"
    save_file(state, str(path))
    model_dir = tmp_path / "bf16-model"  # vLLM's bf16 model: fp8_ranks.py adds FP8 parameters
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    fp8 = {"quantize": "fp8", "expert_parallel": ep}
    versions = {
        "fused": registry.publish(config, state, tp=tp, **fp8),
        "hf": registry.publish(config, state, layout="hf", quantize="fp8"),
    }
    if tp > 1:
        versions["per_rank"] = registry.publish(config, state, tp=tp, per_rank_files=True, **fp8)
    spec: dict[str, Any] = {
        "model_dir": str(model_dir),
        "state": str(path),
        "versions": versions,
        "location": registry.location(f"fp8-tp{tp}-{'ep' if ep else 'tp'}"),
        "expert_parallel": ep,
    }
    results = run_ranks("fp8_ranks.py", tp, spec, tmp_path)
    for result in results:
        assert result["reference"]["disagree"] == []  # vLLM's quantizer is the definition
        # qkv, o, gate_up, down per dense layer; qkv, o and the experts per sparse one
        assert result["fp8_layers"] == (8 if config is FP8_MODEL else 3 + 4)
        assert "torch.float8_e4m3fn" in result["truth_dtypes"]
        for key, parts in result["parts"].items():
            assert parts["wrong"] == [], (result["rank"], key)
            assert parts["missing"] == [], (result["rank"], key)
            # 4 per layer: qkv, o, and gate_up and down or w13 and w2
            assert sum(n.endswith("weight_scale_inv") for n in parts["checked"]) == 8
        # the backend's placement into vLLM's loaders gives the truth, the hf layout's too
        assert result["placed"] == {key: [] for key in versions}, result["rank"]
