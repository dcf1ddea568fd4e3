"""The Qwen3-MoE the trainer builds: torchtitan's MoE on a CPU, and the same function as
transformers' ``Qwen3MoeForCausalLM`` with the same weights under the config it publishes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from weightcast_trainer.model import (
    TINY_MOE,
    IntegerHistc,
    TiedQwen3Model,
    for_device,
    hf_config,
    qwen3_moe_router,
)


def test_integer_histc_counts_as_a_gpus_histc() -> None:
    indices = torch.tensor([[3, 0], [3, 5], [1, 3]])
    with IntegerHistc():
        counts = torch.histc(indices.view(-1), bins=6, min=0, max=6)
        floats = torch.histc(indices.view(-1).float(), bins=6, min=0, max=6)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [1, 1, 0, 3, 0, 1] == floats.tolist()
    with pytest.raises(NotImplementedError):  # what the mode is for
        torch.histc(indices.view(-1), bins=6, min=0, max=6)


@pytest.mark.parametrize(
    ("norm_topk_prob", "dense_layers"),
    [(True, ()), (False, (0,))],
    ids=["renormalised-all-sparse", "raw-layer-0-dense"],
)
def test_the_trainers_moe_computes_transformers_qwen3_moe(
    norm_topk_prob: bool, dense_layers: tuple[int, ...], tmp_path: Path
) -> None:
    """Logits of torchtitan's model (as the trainer builds it, on a CPU) and of transformers'
    ``Qwen3MoeForCausalLM`` loaded by ``from_pretrained`` from :func:`hf_config` and the
    snapshot's tensors agree: same router (softmax, top-k, renormalised or not), same experts."""
    from safetensors.torch import save_file
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter
    from transformers import Qwen3MoeForCausalLM

    router = qwen3_moe_router(num_experts=8, top_k=2, norm_topk_prob=norm_topk_prob)
    args = for_device(dataclasses.replace(TINY_MOE, moe_args=router, dense_layers=dense_layers))
    torch.manual_seed(0)
    model = TiedQwen3Model(args)
    model.init_weights(torch.device("cpu"))
    hf_state = Qwen3StateDictAdapter(args, None).to_hf(model.state_dict())
    save_file({n: t.contiguous() for n, t in hf_state.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf_config(args, "float32")))
    reference = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reference.config.num_experts == 8 and reference.config.norm_topk_prob is norm_topk_prob
    assert reference.config.mlp_only_layers == list(dense_layers)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        theirs = reference(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()


def test_the_tiny_moe_trains_on_a_cpu() -> None:
    """A forward and backward pass: finite loss, a gradient for every expert that got a
    token and for the router, and every token counted top-k times."""
    args = for_device(TINY_MOE)
    torch.manual_seed(0)
    model = TiedQwen3Model(args)
    model.init_weights(torch.device("cpu"))
    tokens = torch.randint(0, args.vocab_size, (1, 64))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, args.vocab_size), tokens.view(-1))
    loss.backward()
    assert torch.isfinite(loss)
    moe = model.layers["0"].moe
    assert moe.tokens_per_expert.sum().item() == 64 * args.moe_args.top_k
    assert moe.router.gate.weight.grad.abs().sum() > 0
    used = moe.tokens_per_expert > 0
    assert (moe.experts.w1.grad.abs().sum(dim=(1, 2)) > 0).tolist() == used.tolist()
