"""One tensor-parallel rank of vLLM's own Qwen3 model, without an engine (the layout truth).

``python vllm_ranks.py RANK TP PORT SPEC.json OUT_DIR``: the ranks of a tp group (one
process each) join a gloo group, build vLLM's ``Qwen3ForCausalLM`` for their rank with
``initialize_model`` (as a worker does, so vLLM records the layerwise-reload metadata) and
load the source HF tensors with vLLM's stock ``load_weights``: that rank's parameters are
the truth. Then each checks, and writes ``OUT_DIR/rank<R>.json``:

* ``parts``: what the backend stages for this rank from each published version (one fused
  file, per-rank files) against the truth, bit for bit;
* ``inplace``: the backend's update, in place, into a fresh model that keeps checkpoint-format
  parameters (as on CUDA): every parameter equals the truth;
* ``layerwise``: the backend's update through vLLM's layerwise reload into a model processed
  as a CPU engine processes it (linear weights repacked), from each version and from the
  ``hf`` layout: every layer computes what a processed truth model computes;
* ``stock_fused``: stock ``load_weights`` fed the fused tensors whole: which parameters
  differ from the truth, and whether it raised;
* ``refused``: updates that must be refused (another tp; a corrupt file of one rank): what
  this rank raised or logged, and whether any parameter changed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def vllm_config(model_dir: str, tp: int, expert_parallel: bool = False) -> Any:
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(
            model=model_dir,
            dtype="bfloat16",
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=256,
        ),
        load_config=LoadConfig(load_format="dummy"),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, enable_expert_parallel=expert_parallel
        ),
        device_config=DeviceConfig(device="cpu"),
    )


def build(model_dir: str, tp: int, expert_parallel: bool = False) -> tuple[Any, torch.nn.Module]:
    """vLLM's model for this rank, dummy weights, as ``initialize_model`` builds it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    config = vllm_config(model_dir, tp, expert_parallel)
    with set_current_vllm_config(config):
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cpu"):
                model = initialize_model(vllm_config=config)
        finally:
            torch.set_default_dtype(default)
    return config, model


def process_like_cpu_engine(config: Any, model: torch.nn.Module) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(config):
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))


def backend(config: Any, model: torch.nn.Module, location: dict[str, str], **init: str) -> Any:
    from vllm.config import WeightTransferConfig

    from weightcast.client.vllm.backend import WeightcastWeightTransferEngine

    engine = WeightcastWeightTransferEngine(
        WeightTransferConfig(backend="weightcast"), config, torch.device("cpu"), model
    )
    engine.init_transfer_engine(engine.parse_init_info({**location, **init}))
    return engine


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def differing(model: torch.nn.Module, truth: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n, p in model.named_parameters() if not torch.equal(p, truth[n]))


@torch.no_grad()
def probe(config: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What every weighted layer computes from fixed inputs (collectives included)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    gen = torch.Generator().manual_seed(0)
    hidden = config.model_config.hf_config.hidden_size
    outputs: dict[str, torch.Tensor] = {}
    with set_current_vllm_config(config):
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                # A MoE router (GateLinear, replicated) knows only its input_size.
                width = getattr(module, "input_size_per_partition", module.input_size)
                x = torch.randn(3, width, generator=gen)
                outputs[name] = module(x.to(torch.bfloat16))[0]
            elif isinstance(module, VocabParallelEmbedding) and not isinstance(
                module, ParallelLMHead
            ):
                outputs[name] = module(torch.tensor([0, 5, 511, 512, 999]))
        h = torch.randn(3, hidden, generator=gen).to(torch.bfloat16)
        outputs["logits"] = model.compute_logits(h)
        outputs["norm"] = model.model.norm(h)
    return outputs


def join_group(model_dir: str, tp: int, rank: int, port: int) -> None:
    """Join this rank's gloo group, as a worker does (the world and the tp groups)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    # vLLM's CPU worker names its shared-memory groups by this before it joins; its tp group
    # reads it whenever vLLM's C extension is already loaded (as the FP8 and MoE layers load it)
    os.environ["VLLM_DIST_IDENT"] = str(port)
    with set_current_vllm_config(vllm_config(model_dir, tp)):
        init_distributed_environment(
            world_size=tp,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(tp)


def fresh_model(
    model_dir: str, tp: int, noise: torch.Generator, expert_parallel: bool = False
) -> tuple[Any, torch.nn.Module]:
    """A new model whose weights are anything but the truth (``initialize_model`` leaves them
    uninitialised: memory a freed model may have filled with it)."""
    cfg, model = build(model_dir, tp, expert_parallel)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=noise) * 0.05)
    return cfg, model


def staged_against(
    config: Any,
    model: torch.nn.Module,
    truth: dict[str, torch.Tensor],
    location: dict[str, str],
    version: int,
    rank: int,
    tp: int,
) -> dict[str, Any]:
    """What the backend stages for this rank (the node's verified reads), against the truth:
    the parts it staged, those that differ, and the bytes."""
    from vllm.config import set_current_vllm_config

    engine = backend(config, model, location)
    info = engine.parse_update_info({"version": version})
    with set_current_vllm_config(config):
        staged = engine._stage(info, rank, tp)
    wrong = []
    for part in staged.parts:
        want, rows = truth[part.name], part.tensor.shape[0]
        if not (torch.equal(want[:rows], part.tensor) and not want[rows:].any()):
            wrong.append(part.name)
    names = sorted(part.name for part in staged.parts)
    return {"checked": names, "wrong": wrong, "bytes": staged.nbytes}


def inplace_against(
    fresh: tuple[Any, torch.nn.Module],
    truth: dict[str, torch.Tensor],
    location: dict[str, str],
    version: int,
) -> dict[str, Any]:
    """The backend's in-place update of a fresh model: its mode, the parameters that differ."""
    from vllm.config import set_current_vllm_config

    cfg, model = fresh
    engine = backend(cfg, model, location, load_mode="inplace")
    with set_current_vllm_config(cfg):
        engine.update_weights({"version": version})
    return {"mode": engine.last_report["mode"], "differing": differing(model, truth)}


def layerwise_against(
    fresh: tuple[Any, torch.nn.Module],
    location: dict[str, str],
    version: int,
    want: dict[str, torch.Tensor],
    probe_of: Callable[[Any, torch.nn.Module], dict[str, torch.Tensor]],
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The backend's update of a fresh model processed as a CPU engine processes it (through
    the layerwise reload): the model, and its mode and the probes that differ from ``want``
    (and that did not change: a probe that misses the update)."""
    from vllm.config import set_current_vllm_config

    cfg, model = fresh
    process_like_cpu_engine(cfg, model)
    engine = backend(cfg, model, location)
    before = probe_of(cfg, model)
    with set_current_vllm_config(cfg):
        engine.update_weights({"version": version})
    got = probe_of(cfg, model)
    return model, {
        "mode": engine.last_report["mode"],
        "probed": sorted(want),
        "differing": sorted(k for k in want if not torch.equal(got[k], want[k])),
        "unchanged": sorted(k for k in want if torch.equal(got[k], before[k])),
    }


def refusal_against(
    fresh: tuple[Any, torch.nn.Module],
    source: dict[str, torch.Tensor],
    truth: dict[str, torch.Tensor],
    location: dict[str, str],
    version: int,
) -> dict[str, Any]:
    """An update that must be refused, into a model holding the truth: what this rank raised
    or reported, and the parameters that changed."""
    from vllm.config import set_current_vllm_config

    cfg, model = fresh
    with set_current_vllm_config(cfg):
        model.load_weights(iter(source.items()))
    engine = backend(cfg, model, location)
    raised = None
    with set_current_vllm_config(cfg):
        try:
            engine.update_weights({"version": version})
        except Exception as exc:
            raised = f"{type(exc).__name__}: {exc}"
    return {"raised": raised, "report": engine.last_report, "differing": differing(model, truth)}


def main(rank: int, tp: int, port: int, spec_path: str, out_dir: str) -> None:
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    spec = json.loads(Path(spec_path).read_text())
    versions: dict[str, int] = spec["versions"]
    location, model_dir = spec["location"], spec["model_dir"]
    result: dict[str, Any] = {"rank": rank, "tp": tp}
    try:
        join_group(model_dir, tp, rank, port)
        source = load_file(spec["state"])
        noise = torch.Generator().manual_seed(rank)

        config, truth_model = fresh_model(model_dir, tp, noise)
        with set_current_vllm_config(config):
            truth_model.load_weights(iter(source.items()))
        truth = params(truth_model)

        splits = [key for key in ("fused", "per_rank") if key in versions]
        result["parts"] = {
            key: staged_against(config, truth_model, truth, location, versions[key], rank, tp)
            for key in splits
        }
        result["inplace"] = {
            key: inplace_against(fresh_model(model_dir, tp, noise), truth, location, versions[key])
            for key in splits
        }

        # Layerwise into a model processed as a CPU engine processes it.
        process_like_cpu_engine(config, truth_model)
        # A CPU with oneDNN's kernels repacks each linear weight away (shape [0]); one without
        # (AVX2 alone) keeps torch's linear and the weight: the reload must leave either as is.
        processed = list(truth_model.model.layers[0].self_attn.qkv_proj.weight.shape)
        result["processed_qkv_shape"] = processed
        want = probe(config, truth_model)
        result["layerwise"] = {}
        for key in ("fused", "per_rank", "hf"):
            if key in versions:
                fresh = fresh_model(model_dir, tp, noise)
                model, update = layerwise_against(fresh, location, versions[key], want, probe)
                qkv = model.model.layers[0].self_attn.qkv_proj.weight
                result["layerwise"][key] = update | {"live_qkv_shape": list(qkv.shape)}

        # Stock load_weights fed the fused tensors whole, under their fused names.
        cfg, model = fresh_model(model_dir, tp, noise)
        fused = load_file(spec["fused_file"])
        raised = None
        with set_current_vllm_config(cfg):
            try:
                model.load_weights(iter(fused.items()))
            except Exception as exc:
                raised = f"{type(exc).__name__}: {exc}"
        result["stock_fused"] = {"raised": raised, "differing": differing(model, truth)}

        # Refusals: nothing changes on any rank.
        result["refused"] = {
            key: refusal_against(
                fresh_model(model_dir, tp, noise), source, truth, location, versions[key]
            )
            for key in ("wrong_tp", "rank1_corrupt")
            if key in versions
        }
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
