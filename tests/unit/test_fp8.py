"""Block-scaled FP8 (weightcast.contract.fp8) against the format's definition, block by block,
and the scale tensors the plan lays out beside fused FP8 weights (contract.block_scales)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weightcast.contract import fp8
from weightcast.contract.errors import BlockCutError
from weightcast.contract.model_shape import hf_tensor_shapes
from weightcast.contract.plan import plan_version
from weightcast.contract.sharding import ShardKind

from helpers.fp8_versions import fp8_sources, published, quantized_checkpoint
from helpers.models import moe_shape, shape_of
from vllm_reference import fp8_block_quantize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (128, 128), (64, 1000)])
def test_quantize_is_the_definition_bit_for_bit(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """bf16 through its bits (fp8._amax), the others through torch."""
    gen = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    weight[:64, :64] *= 1000  # blocks of very different ranges
    got, scale = fp8.quantize(weight)
    want, want_scale = fp8_block_quantize(weight)
    assert got.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    assert tuple(scale.shape) == fp8.scale_shape(shape)


def test_a_zero_block_gets_the_floor_scale_never_zero() -> None:
    weight = torch.zeros(256, 256, dtype=torch.bfloat16)
    weight[128:, 128:] = 0.5
    q, scale = fp8.quantize(weight)
    floor = torch.tensor(fp8.AMAX_FLOOR, dtype=torch.float32) / 448
    assert scale[0, 0] == floor and scale[1, 1] == torch.tensor(0.5) / 448
    assert not q.view(torch.uint8)[:128, :128].any()  # zeros stay zeros
    assert (scale > 0).all()


def test_a_non_finite_block_has_a_non_finite_scale() -> None:
    """What the publisher's finiteness check refuses: no such block is ever published."""
    weight = torch.ones(256, 256, dtype=torch.bfloat16)
    weight[3, 200] = float("nan")
    weight[200, 3] = float("inf")
    scale = fp8.block_scales(weight)
    assert torch.isfinite(scale[0, 0]) and torch.isfinite(scale[1, 1])
    assert not torch.isfinite(scale[0, 1]) and not torch.isfinite(scale[1, 0])


def test_rows_quantized_alone_under_the_whole_scales_are_the_whole_rows() -> None:
    """The publisher quantizes each rank's rows (or columns) from a read of them alone."""
    weight = (torch.randn(384, 300) * 0.1).to(torch.bfloat16)
    whole, scale = fp8.quantize(weight)
    rows = fp8.apply_scales(weight[128:384], scale[1:3])
    assert torch.equal(rows.view(torch.uint8), whole[128:384].view(torch.uint8))
    cols = fp8.apply_scales(weight[:, 128:256].contiguous(), scale[:, 1:2].contiguous())
    assert torch.equal(cols.view(torch.uint8), whole[:, 128:256].view(torch.uint8))


def test_dequantize_is_within_half_a_step_of_the_source() -> None:
    weight = (torch.randn(256, 384) * 0.05).to(torch.bfloat16)
    q, scale = fp8.quantize(weight)
    back = fp8.dequantize(q, scale, torch.float32)
    # e4m3: 3 mantissa bits, so an error of at most 1/16 of the value (or of the least
    # normal's step for tiny ones: 2^-9 of the scale's unit)
    step = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    bound = torch.maximum(weight.float().abs() / 16, step * 2**-9)
    assert ((back - weight.float()).abs() <= bound).all()
    experts = torch.stack([q, q])
    assert torch.equal(fp8.dequantize(experts, torch.stack([scale, scale]))[1], back)
    with pytest.raises(ValueError, match="does not fit"):
        fp8.dequantize(q, scale[:1])


def test_weights_as_an_fp8_version_serves_them() -> None:
    """What the trainer's forward uses to score batches an FP8 engine sampled."""
    gen = torch.Generator().manual_seed(3)
    shapes = hf_tensor_shapes(FP8_SHAPE)
    weights = {
        n: (torch.randn(s, generator=gen) * 0.05).to(torch.bfloat16) for n, s in shapes.items()
    }
    served = fp8.as_served(weights)
    checkpoint: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if fp8.is_quantized(name, tuple(w.shape)):
            checkpoint[name], checkpoint[fp8.scale_name(name)] = fp8_block_quantize(w)
        else:
            checkpoint[name] = w
    back = fp8.dequantize_checkpoint(checkpoint, torch.bfloat16)
    assert sorted(back) == sorted(served) == sorted(weights)
    for name, w in served.items():
        assert w.dtype == torch.bfloat16 and torch.equal(back[name], w), name
        same = torch.equal(w, weights[name])
        assert same == (not fp8.is_quantized(name, tuple(w.shape))), name


def test_representable_values_come_back_exactly() -> None:
    """A block whose amax is 448 times a power of two has that power of two as its scale, so
    every e4m3 value times it is quantized without rounding."""
    gen = torch.Generator().manual_seed(5)
    values = (torch.randn(256, 200, generator=gen) * 40).to(torch.float8_e4m3fn).float()
    values[0, 0] = values[128, 0] = values[0, 128] = values[128, 128] = 448.0
    weight = values * 2.0**-9
    back = fp8.dequantize(*fp8.quantize(weight))
    assert torch.equal(back, weight)
    assert torch.equal(fp8.quantize(weight)[1], torch.full((2, 2), 2.0**-9))


def test_which_tensors_are_quantized() -> None:
    shapes = hf_tensor_shapes(moe_shape())
    quantized = sorted(n for n, s in shapes.items() if fp8.is_quantized(n, s))
    assert all(n.endswith("_proj.weight") for n in quantized)
    assert not [n for n in quantized if "embed" in n or "norm" in n or "mlp.gate." in n]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in quantized
    assert "model.layers.1.mlp.gate_proj.weight" in quantized  # the dense layer
    assert not fp8.is_quantized("lm_head.weight", (64, 16))
    assert not fp8.is_quantized("model.layers.0.self_attn.q_proj.bias", (32,))
    assert fp8.scale_name("a.qkv_proj.weight") == "a.qkv_proj.weight_scale_inv"
    assert fp8.weight_name("a.w13_weight_scale_inv") == "a.w13_weight"
    assert fp8.weight_name("a.weight") is None


FP8_SHAPE = shape_of(4, 2, 128, hidden=256, inter=512, tied=False)
"""Every tp-sharded dimension whole 128-blocks up to tp 4 (kv heads replicated at 4)."""
MOE_FP8 = dataclasses.replace(
    moe_shape(experts=4, moe_inter=256),
    hidden_size=256,
    num_heads=2,
    head_dim=128,
    num_kv_heads=2,
    intermediate_size=256,
)


RAGGED = shape_of(4, 2, 128, hidden=200, inter=512, tied=False)
"""Rows of o_proj and down_proj (hidden 200) not whole blocks: at tp 2 the second rank's part
starts a block of its own mid-way through the whole grid's second block."""


@pytest.mark.parametrize(
    ("shape", "tp", "ep"), [(RAGGED, 1, 1), (RAGGED, 2, 1), (MOE_FP8, 2, 1), (MOE_FP8, 2, 2)]
)
def test_a_published_fp8_version_dequantizes_rank_by_rank(shape, tp: int, ep: int) -> None:
    """Dequantizing the fused FP8 tensors of every rank gives the fused layout of the
    dequantized HF weights, value for value, and no scales."""
    weights, checkpoint = quantized_checkpoint(shape, seed=tp + ep)
    fp8_version = published(plan_version(fp8_sources(shape), shape, tp, ep=ep), checkpoint)
    got = fp8.dequantize_checkpoint(fp8_version, torch.float32, tp)
    hf = fp8.dequantize_checkpoint(checkpoint, torch.float32)
    floats = {n: ("F32", tuple(t.shape)) for n, t in hf.items()}
    want = published(plan_version(floats, shape, tp, ep=ep), hf)
    assert sorted(got) == sorted(want) and not [n for n in got if fp8.weight_name(n)]
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
    for name, w in weights.items():  # e4m3: within 1/16 of each value, or of a tiny step
        if fp8.is_quantized(name, tuple(w.shape)):
            step = hf[name].abs().amax() * 2**-9
            assert ((hf[name] - w.float()).abs() <= w.float().abs() / 16 + step).all(), name
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    if shape is RAGGED and tp > 1:  # one grid over both ranks' rows would be wrong there
        whole = fp8.dequantize(fp8_version[o_proj], fp8_version[fp8.scale_name(o_proj)])
        assert not torch.equal(whole, got[o_proj])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_fused_fp8_weight_has_its_scale_in_blocks(tp: int) -> None:
    plan = plan_version(fp8_sources(FP8_SHAPE), FP8_SHAPE, tp, per_rank_files=tp > 1)
    for file in plan.fused:
        tensors = {t.name: t for t in file.tensors}
        for t in file.tensors:
            if t.dtype == fp8.FP8_DTYPE:
                scale = tensors[fp8.scale_name(t.name)]
                assert scale.dtype == "F32"
                assert scale.shape == fp8.scale_shape(t.shape), t.name
                if t.shard.fused:
                    assert scale.shard.rank_rows * 128 == t.shard.rank_rows, t.name
            elif t.name.endswith("weight_scale_inv"):
                assert fp8.weight_name(t.name) in tensors
            else:
                assert t.dtype == "BF16" and "_proj." not in t.name
    layer = {t.name: t for t in plan.fused[0].tensors}
    qkv = layer["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
    kv_blocks = 1 if tp > 1 else 2  # one replicated head per rank at tp 2 and 4
    assert qkv.shard.kind == ShardKind.QKV and qkv.shard.kv_rows == kv_blocks
    o = layer["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    assert o.shape == (2, 4 // tp)  # 256 out rows, this rank's 512 / tp columns


def test_a_tp_that_cuts_a_block_is_refused_naming_the_tensor() -> None:
    shape = dataclasses.replace(FP8_SHAPE, intermediate_size=384)  # 192 rows per rank at tp 2
    plan_version(fp8_sources(shape), shape, 1)  # tp 1: gate's 3 blocks are whole
    with pytest.raises(BlockCutError, match=r"^model\.layers\.0\.mlp\.down_proj\.weight: colu"):
        plan_version(fp8_sources(shape), shape, 2)
    small = shape_of(4, 1, 64, hidden=256, inter=512)  # one kv head of 64 rows
    with pytest.raises(BlockCutError, match=r"qkv_proj\.weight: rows 0\.\.64 of .*k_proj"):
        plan_version(fp8_sources(small), small, 1)


def test_moe_experts_carry_their_scales_at_tp_and_ep() -> None:
    shape = MOE_FP8
    for ep in (1, 2):
        plan = plan_version(fp8_sources(shape), shape, 2, ep=ep)
        tensors = {t.name: t for t in plan.fused[0].tensors}
        w13 = tensors["model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv"]
        w2 = tensors["model.layers.0.mlp.experts.routed_experts.w2_weight_scale_inv"]
        per_rank = 256 // 128 // (2 if ep == 1 else 1)
        experts = 8 if ep == 1 else 4
        assert w13.shape == (experts, 2 * per_rank, 2) and w13.shard.kind == ShardKind.EXPERTS
        assert w2.shape == (experts, 2, per_rank)
