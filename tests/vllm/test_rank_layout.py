"""Per-rank truth from vLLM's own model and loaders, for tp 1, 2 and 4 (4 > the 2 kv heads).

One process per rank builds vLLM's ``Qwen3ForCausalLM`` for its rank over gloo and loads the
source tensors with stock ``load_weights`` (``vllm_ranks.py``). Against that truth: what the
backend stages from versions the real publisher wrote (one fused file, per-rank files),
the backend's in-place and layerwise updates (the ``hf`` layout too), stock ``load_weights``
fed fused names, and refusals that leave every rank untouched. The model has a vocabulary
of 1000, which vLLM pads to 1024, so the last rank's share is short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from weightcast.contract.layout import FUSED_WEIGHTS_FILE, fused_rank_file

from conftest import flip_byte
from vllm_helpers import ODD_VOCAB, UNTIED_BIASED, Registry, random_state, run_ranks

MODELS = {"tied": ODD_VOCAB, "untied_biased": UNTIED_BIASED}


@pytest.fixture(scope="module")
def sources(registry: Registry, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per model of :data:`MODELS`, made on first use: its source tensors and hf version."""
    made: dict[str, Any] = {}

    def source(model: str) -> dict[str, Any]:
        if model not in made:
            config = MODELS[model]
            state = random_state(config, 21)
            path = tmp_path_factory.mktemp("source") / "state.safetensors"
            save_file(state, str(path))
            hf = registry.publish(config, state, layout="hf")
            made[model] = {
                "config": config,
                "state": state,
                "file": path,
                "hf": hf,
                "model_dir": registry.versions[hf],
            }
        return made[model]

    return source  # type: ignore[return-value]


def publish_and_run(
    tp: int, registry: Registry, source: dict[str, Any], tmp_path: Path
) -> list[dict[str, Any]]:
    state, config = source["state"], source["config"]
    versions = {"hf": source["hf"], "fused": registry.publish(config, state, tp=tp)}
    versions["wrong_tp"] = registry.publish(config, state, tp=2 if tp == 1 else 1)
    if tp > 1:
        versions["per_rank"] = registry.publish(config, state, tp=tp, per_rank_files=True)
        versions["rank1_corrupt"] = registry.publish(config, state, tp=tp, per_rank_files=True)
        flip_byte(registry.versions[versions["rank1_corrupt"]] / fused_rank_file(1, tp))
    spec = {
        "model_dir": str(source["model_dir"]),
        "state": str(source["file"]),
        "fused_file": str(registry.versions[versions["fused"]] / FUSED_WEIGHTS_FILE),
        "versions": versions,
        "location": registry.location(f"ranks-tp{tp}"),
    }
    return run_ranks("vllm_ranks.py", tp, spec, tmp_path)


@pytest.mark.parametrize(
    ("model", "tp"), [("tied", 1), ("tied", 2), ("tied", 4), ("untied_biased", 2)]
)
def test_every_rank_holds_exactly_what_vllm_loads(
    model: str, tp: int, registry: Registry, sources: Any, tmp_path: Path
) -> None:
    """The untied model with attention biases: vLLM's layerwise metadata records no bias,
    and the backend refused such versions in every mode until it read the live bias."""
    results = publish_and_run(tp, registry, sources(model), tmp_path)
    layouts = ["fused", "per_rank"] if tp > 1 else ["fused"]
    # embed, norm; 8 per layer (a fused qkv bias a 9th); an untied lm_head
    tensors = 2 + 2 * (9 if model == "untied_biased" else 8) + (model == "untied_biased")
    for result in results:
        # The backend stages, for each rank, the parameters vLLM's loaders give it.
        for key in layouts:
            assert result["parts"][key]["wrong"] == [], (result["rank"], key)
            assert len(result["parts"][key]["checked"]) == tensors
        # In place (a platform that keeps checkpoint-format parameters): bit for bit.
        for key in layouts:
            assert result["inplace"][key] == {"mode": "inplace", "differing": []}
        # Layerwise into a CPU-processed model (linear weights repacked away where the CPU
        # has oneDNN's kernels): every layer, the tied lm_head's logits included, computes
        # what the truth computes, and the model stays processed as the engine processed it.
        for key in [*layouts, "hf"]:
            update = result["layerwise"][key]
            assert update["mode"] == "layerwise"
            assert update["live_qkv_shape"] == result["processed_qkv_shape"]
            assert update["differing"] == [], (result["rank"], key)
            assert update["unchanged"] == [], (result["rank"], key)  # dummy -> real weights
        # Stock load_weights takes the fused names, right only at tp=1. At tp > 1 the
        # row-parallel tensors ([tp * rows, columns / tp], format 3) trip RowParallelLinear's
        # loader (its shape assertion on rank 0, a narrow past the columns on the others),
        # after the fused tensors before them were loaded wrong.
        stock = result["stock_fused"]
        if tp == 1:
            assert stock["raised"] is None and stock["differing"] == []
        else:
            assert stock["raised"] is not None and stock["differing"], stock
        # A version that some rank must refuse changes nothing on any rank; only the last
        # rank raises, with every rank's reason.
        last = result["rank"] == tp - 1
        for key, reason in [
            ("wrong_tp", f"is fused for tp={2 if tp == 1 else 1}; this engine runs tp={tp}"),
            ("rank1_corrupt", "model-rank-01-of-"),
        ]:
            if key not in result["refused"]:
                continue
            refused = result["refused"][key]
            assert refused["differing"] == [], (result["rank"], key)
            assert refused["report"]["failed"].endswith("refused, no parameter touched")
            assert (refused["raised"] is not None) == last
            if last:
                assert reason in refused["raised"], refused
    if tp > 1:  # only rank 1 read a bad file; every rank refused, and knows why
        verdicts = results[0]["refused"]["rank1_corrupt"]["report"]["ranks"]
        assert [v is None for v in verdicts] == [r != 1 for r in range(tp)], verdicts
        assert "model-rank-01-of-" in verdicts[1]
