"""Per-rank truth from vLLM's own Qwen3-MoE model and loaders: tp 1, 2, 4, each of tp 2 and 4
also with expert parallelism (one process group per tp runs both placements).

The checkpoint is transformers' ``Qwen3MoeForCausalLM(...).save_pretrained`` (HF expert names,
a dense layer among sparse ones via ``mlp_only_layers``, 8 experts, a vocabulary of 1000). One
process per rank builds vLLM's model for its rank over gloo and loads that checkpoint with
stock ``load_weights`` (``moe_ranks.py``). Against that truth: what the backend stages from
versions the real publisher wrote (one fused file, per-rank files), its in-place and layerwise
updates (the ``hf`` layout too), and a version laid out for the other placement, refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from weightcast.contract.errors import ConfigError
from weightcast.contract.experts import FUSED_MOE

from helpers.models import EXPERTS, HIDDEN, MOE_INTER
from vllm_helpers import Registry, moe_checkpoint, run_ranks


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = moe_checkpoint(tmp_path_factory.mktemp("moe") / "checkpoint")
    config = json.loads((path / "config.json").read_text())
    return {"dir": path, "config": config, "state": load_file(str(path / "model.safetensors"))}


def publish_placements(
    tp: int, registry: Registry, checkpoint: dict[str, Any]
) -> list[dict[str, Any]]:
    config, state = checkpoint["config"], checkpoint["state"]
    hf = registry.publish(config, state, layout="hf")
    placements = []
    for ep in [False, True] if tp > 1 else [False]:
        versions = {"hf": hf, "fused": registry.publish(config, state, tp=tp, expert_parallel=ep)}
        if tp > 1:
            versions["per_rank"] = registry.publish(
                config, state, tp=tp, per_rank_files=True, expert_parallel=ep
            )
            versions["other_placement"] = registry.publish(
                config, state, tp=tp, expert_parallel=not ep
            )
        placements.append(
            {"name": "ep" if ep else "tp", "expert_parallel": ep, "versions": versions}
        )
    return placements


def publish_and_run(
    tp: int, registry: Registry, checkpoint: dict[str, Any], tmp_path: Path
) -> list[dict[str, Any]]:
    spec = {
        "model_dir": str(checkpoint["dir"]),
        "state": str(checkpoint["dir"] / "model.safetensors"),
        "placements": publish_placements(tp, registry, checkpoint),
        "location": registry.location(f"moe-ranks-tp{tp}"),
    }
    return run_ranks("moe_ranks.py", tp, spec, tmp_path)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_holds_exactly_what_vllm_loads_for_experts(
    tp: int, registry: Registry, checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    results = publish_and_run(tp, registry, checkpoint, tmp_path)
    layouts = ["fused", "per_rank"] if tp > 1 else ["fused"]
    w13, w2 = f"model.layers.0.{FUSED_MOE}.w13_weight", f"model.layers.0.{FUSED_MOE}.w2_weight"
    for result in results:
        for name in ["tp", "ep"] if tp > 1 else ["tp"]:
            out, where = result[name], (result["rank"], name)
            # vLLM's own parameters: each expert split over the ranks, or whole experts.
            local, width = (
                (EXPERTS // tp, MOE_INTER) if name == "ep" else (EXPERTS, MOE_INTER // tp)
            )
            assert out["expert_shapes"][w13] == [local, 2 * width, HIDDEN], where
            assert out["expert_shapes"][w2] == [local, HIDDEN, width], where
            for key in layouts:
                parts = out["parts"][key]
                assert parts["wrong"] == [], (where, key)
                assert w13 in parts["checked"] and w2 in parts["checked"]
                assert "model.layers.1.mlp.gate_up_proj.weight" in parts["checked"]
                assert "model.layers.2.mlp.gate.weight" in parts["checked"]
            if tp > 1:  # each rank's reads are its own share, per-rank files or not
                assert out["parts"]["fused"]["bytes"] == out["parts"]["per_rank"]["bytes"]
            for key in layouts:
                assert out["inplace"][key] == {"mode": "inplace", "differing": []}, (where, key)
            for key in [*layouts, "hf"]:
                update = out["layerwise"][key]
                assert update["mode"] == "layerwise"
                assert len(update["experts"]) == 4 and update["experts_differing"] == [], where
                blocks = {"layers.0.moe", "layers.2.moe"} if name == "tp" else set()
                assert blocks | {"logits"} <= set(update["probed"])
                assert update["differing"] == [], (where, key)
                assert update["unchanged"] == [], (where, key)
            if tp > 1:  # a version for the other placement: refused, nothing touched
                refused = out["refused"]["other_placement"]
                assert refused["differing"] == [], where
                assert refused["report"]["failed"].endswith("refused, no parameter touched")
                if result["rank"] == tp - 1:
                    other = 1 if name == "ep" else tp
                    assert f"lays its experts out for ep={other}" in refused["raised"]
                else:
                    assert refused["raised"] is None


def test_experts_that_ranks_do_not_divide_are_refused_in_one_line(
    registry: Registry, tmp_path: Path
) -> None:
    path = moe_checkpoint(tmp_path / "six", experts=6)
    config = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    with pytest.raises(ConfigError) as error:
        registry.publish(config, state, tp=4, expert_parallel=True)
    message = str(error.value)
    assert "publisher.tp=4 with publisher.expert_parallel cannot serve the model" in message
    assert "expert parallel over 4 ranks does not divide the 6 experts evenly" in message
    assert "\n" not in message
