"""FP8 versions built in memory from the contract alone: an HF state quantized with the
contract's quantizer, planned and laid out as the publisher lays it out."""

from __future__ import annotations

import torch

from weightcast.contract import fp8
from weightcast.contract.model_shape import ModelShape, hf_tensor_shapes
from weightcast.contract.plan import VersionPlan
from weightcast.contract.regions import ColumnRange


def fp8_sources(shape: ModelShape) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What the quantizing source shows the plan: FP8 linear weights, their scales, the rest."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, size in hf_tensor_shapes(shape).items():
        if fp8.is_quantized(name, size):
            out[name] = (fp8.FP8_DTYPE, tuple(size))
            out[fp8.scale_name(name)] = (fp8.SCALE_DTYPE, fp8.scale_shape(size))
        else:
            out[name] = ("BF16", tuple(size))
    return out


def quantized_checkpoint(
    shape: ModelShape, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A random bf16 state of ``shape`` (blocks of very different ranges) and its FP8
    checkpoint, quantized with the contract's quantizer."""
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    checkpoint: dict[str, torch.Tensor] = {}
    for name, size in hf_tensor_shapes(shape).items():
        w = (torch.randn(size, generator=gen) * 0.05).to(torch.bfloat16)
        if fp8.is_quantized(name, size):
            w[:64] *= 300
            checkpoint[name], checkpoint[fp8.scale_name(name)] = fp8.quantize(w)
        else:
            checkpoint[name] = w
        weights[name] = w
    return weights, checkpoint


def published(plan: VersionPlan, sources: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole tensors of a version planned over ``sources``: each its regions' row-major
    bytes, in order (what a node reading every rank holds)."""
    out: dict[str, torch.Tensor] = {}
    for file in plan.fused:
        for t in file.tensors:
            parts = [
                sources[r.source][:, r.start : r.stop]
                if isinstance(r, ColumnRange)
                else sources[r.source][r.start : r.stop]
                for r in t.regions
            ]
            out[t.name] = torch.cat([p.reshape(-1) for p in parts]).view(t.shape)
    return out
