"""FP8 versions per rank against vLLM's own Qwen3 with block-FP8 parameters, dense at tp 1,
2 and 4 (4 > the 2 kv heads: replicated), one process per rank over gloo (``fp8_ranks.py``,
whose doc says why the parameters are made by vLLM's functions rather than by its kernel
choice, which needs AMX). The truth is stock ``load_weights`` of a checkpoint quantized by
vLLM's ``per_block_cast_to_fp8`` from the same bf16 weights; what the backend stages for each
rank from versions the real publisher wrote (one fused file; per-rank files) must be it, bit
for bit, every weight and every scale.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from weightcast.contract.model_shape import SHAPES

from vllm_helpers import Registry, random_state, run_ranks

FP8_MODEL = replace(
    SHAPES["tiny"],
    hidden_size=256,
    intermediate_size=512,
    num_heads=4,
    num_kv_heads=2,
    head_dim=128,
    vocab_size=1000,
).to_hf_config()
"""Every tp-split dimension whole 128-blocks up to tp 4."""


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_stages_exactly_what_vllm_loads_from_an_fp8_checkpoint(
    tp: int, registry: Registry, tmp_path: Path
) -> None:
    state = random_state(FP8_MODEL, 31)
    path = tmp_path / "state.safetensors"
    save_file(state, str(path))
    model_dir = tmp_path / "bf16-model"  # vLLM's bf16 model: fp8_ranks.py adds FP8 parameters
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(FP8_MODEL))
    versions = {"fused": registry.publish(FP8_MODEL, state, tp=tp, quantize="fp8")}
    if tp > 1:
        versions["per_rank"] = registry.publish(
            FP8_MODEL, state, tp=tp, per_rank_files=True, quantize="fp8"
        )
    spec: dict[str, Any] = {
        "model_dir": str(model_dir),
        "state": str(path),
        "versions": versions,
        "location": registry.location(f"fp8-tp{tp}"),
    }
    results = run_ranks("fp8_ranks.py", tp, spec, tmp_path)
    for result in results:
        assert result["reference"]["disagree"] == []  # vLLM's quantizer is the definition
        assert result["fp8_layers"] == 2 * 4  # qkv, o, gate_up, down per layer
        assert "torch.float8_e4m3fn" in result["truth_dtypes"]
        for key, parts in result["parts"].items():
            assert parts["wrong"] == [], (result["rank"], key)
            assert parts["missing"] == [], (result["rank"], key)
            assert sum(n.endswith("weight_scale_inv") for n in parts["checked"]) == 8
