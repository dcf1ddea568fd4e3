"""Block-scaled FP8: the format of the published Qwen3 FP8 checkpoints, as pure functions.

Each linear weight (``q/k/v/o_proj``, ``gate/up/down_proj``, dense and per expert) is stored as
``float8_e4m3fn`` with a float32 ``weight_scale_inv`` holding one scale per 128 x 128 block
(``[ceil(rows / 128), ceil(columns / 128)]``); the dequantized weight is ``fp8 * scale``,
block by block. The embedding, the norms, the router (``mlp.gate``) and ``lm_head`` stay in
the source dtype, as those checkpoints leave them. The checkpoint's ``config.json`` carries
:data:`QUANTIZATION_CONFIG`, which vLLM's ``Fp8Config`` reads.

:func:`quantize` follows vLLM's reference block quantizer (``per_block_cast_to_fp8``, the
DeepGEMM one): per block ``amax = max |x|`` in float32, clamped below at :data:`AMAX_FLOOR`
so that an all-zero block gets a tiny positive scale, never a zero one (its values quantize to
zero all the same); ``scale = amax / 448``; ``fp8 = (x * (1 / scale)).to(float8_e4m3fn)``. A
block holding NaN or infinity has a non-finite scale: the publisher's finiteness check refuses
the snapshot, so no such block is ever published. :func:`dequantize` is the inverse the
trainer uses to score what an FP8 engine samples from (:func:`as_served`: bf16 weights as an
FP8 version serves them; :func:`dequantize_checkpoint`: an FP8 checkpoint's or a published FP8
version's weights, which the transformers rollout node samples with).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only for the math; naming and the config need none
    import torch

BLOCK = 128
"""Rows and columns of a scale block (``weight_block_size`` ``[128, 128]``)."""
FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn``."""
AMAX_FLOOR = 1e-4
"""The least block amax a scale is computed from (vLLM's reference quantizer's clamp)."""
FP8_DTYPE = "F8_E4M3"
SCALE_DTYPE = "F32"
SCALE_SUFFIX = "weight_scale_inv"
QUANTIZE_NONE, QUANTIZE_FP8 = "none", "fp8"
QUANTIZE_CHOICES = (QUANTIZE_NONE, QUANTIZE_FP8)
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
"""What ``config.json`` carries (``quantization_config``) for an FP8 version."""

_LINEAR = re.compile(r"^model\.layers\.\d+\..*\.(q|k|v|o|gate|up|down)_proj\.weight$")


def is_quantized(name: str, shape: tuple[int, ...] | list[int]) -> bool:
    """Whether the HF tensor ``name`` is stored as FP8: a linear layer's 2-D weight."""
    return len(shape) == 2 and _LINEAR.match(name) is not None


def scale_name(weight: str) -> str:
    """The scale of weight ``weight`` (HF or fused): ``...weight`` -> ``...weight_scale_inv``."""
    if not weight.endswith("weight"):
        raise ValueError(f"{weight} is no weight")
    return weight[: -len("weight")] + SCALE_SUFFIX


def weight_name(scale: str) -> str | None:
    """The weight a scale tensor belongs to, or None for a name that is no scale."""
    return scale[: -len(SCALE_SUFFIX)] + "weight" if scale.endswith(SCALE_SUFFIX) else None


def blocks(size: int) -> int:
    """The blocks covering ``size`` rows or columns."""
    return -(-size // BLOCK)


def scale_shape(shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """A weight's scale shape: its last two dims in blocks (leading dims, experts, kept)."""
    return (*shape[:-2], blocks(shape[-2]), blocks(shape[-1]))


def quantized_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` of an FP8 version: the source config with its ``quantization_config``."""
    return {**config, "quantization_config": dict(QUANTIZATION_CONFIG)}


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scale per block)`` of a 2-D weight (see the module's doc)."""
    scale = block_scales(weight)
    return apply_scales(weight, scale), scale


def block_scales(weight: torch.Tensor) -> torch.Tensor:
    """The float32 ``weight_scale_inv`` of a 2-D weight: ``max(amax, floor) / 448`` per block."""
    if weight.dim() != 2:
        raise ValueError(f"quantize takes a matrix, not shape {list(weight.shape)}")
    return _amax(_padded(weight)).clamp(AMAX_FLOOR) / FP8_MAX


def _amax(padded: torch.Tensor) -> torch.Tensor:
    """Each block's ``max |x|`` in float32. A bf16 weight's is found on its bits: with the
    sign bit cleared, bf16 patterns order as their magnitudes do (NaN above infinity, so a NaN
    gives a NaN), and a bf16 is the top half of the float32 of the same value: exactly
    torch's ``abs().amax()``, eight times faster on a CPU."""
    import numpy as np
    import torch

    rows, cols = padded.shape[0] // BLOCK, padded.shape[1] // BLOCK
    if padded.dtype != torch.bfloat16:
        return padded.view(rows, BLOCK, cols, BLOCK).abs().amax(dim=(1, 3)).float()
    bits = padded.view(torch.int16).numpy().view(np.uint16)
    top = (bits & 0x7FFF).reshape(rows, BLOCK, cols, BLOCK).max(axis=(1, 3))
    return torch.from_numpy((top.astype(np.uint32) << 16).view(np.float32))


def apply_scales(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight`` (2-D, starting on a block row and column) as FP8 under ``scale``, its
    blocks' scales (``weight``'s rows may be a part of a weight's, in whole blocks but for a
    ragged end): ``(x * (1 / scale)).to(float8_e4m3fn)`` elementwise, in float32."""
    import torch

    rows, cols = weight.shape
    if tuple(scale.shape) != (blocks(rows), blocks(cols)):
        raise ValueError(f"scale {list(scale.shape)} does not fit a weight {[rows, cols]}")
    padded = _padded(weight)
    inverse = (1.0 / scale).view(blocks(rows), 1, blocks(cols), 1)
    # the same float32 products as ``view * inverse``, 2-3x faster on a CPU: torch's
    # broadcast multiply of bf16 by float32 is slow, in place on float32 it is not
    values = padded.float() if padded.dtype != torch.float32 else padded.clone()
    values.view(blocks(rows), BLOCK, blocks(cols), BLOCK).mul_(inverse)
    fp8 = values.to(torch.float8_e4m3fn)
    return fp8 if padded is weight else fp8[:rows, :cols].contiguous()


def _padded(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` zero-padded to whole blocks (itself when it is)."""
    rows, cols = weight.shape
    if not (rows % BLOCK or cols % BLOCK) and weight.is_contiguous():
        return weight
    padded = weight.new_zeros(blocks(rows) * BLOCK, blocks(cols) * BLOCK)
    padded[:rows, :cols] = weight
    return padded


def dequantize(
    fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The weight an FP8 engine computes with: each block of ``fp8`` times its scale, in
    ``dtype`` (default float32). Leading dims (experts) are kept."""
    if fp8.shape[:-2] != scale.shape[:-2] or tuple(scale.shape) != scale_shape(fp8.shape):
        raise ValueError(f"scale {list(scale.shape)} does not fit a weight {list(fp8.shape)}")
    rows, cols = fp8.shape[-2:]
    full = scale.float().repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    out = fp8.float() * full[..., :rows, :cols]
    return out if dtype is None else out.to(dtype)


def dequantize_checkpoint(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, tp: int = 1
) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's tensors (HF names, or a published version's vllm-fused ones laid
    out for ``tp`` ranks) as the weights an FP8 engine computes with: each weight that has a
    ``weight_scale_inv`` dequantized to ``dtype`` (:func:`dequantize_ranks`), the scales
    dropped, everything else as it is."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if weight_name(name) is not None:
            continue
        scale = tensors.get(scale_name(name)) if name.endswith("weight") else None
        out[name] = tensor if scale is None else dequantize_ranks(tensor, scale, tp, dtype)
    return out


def dequantize_ranks(
    fp8: torch.Tensor, scale: torch.Tensor, tp: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A published weight as ``tp`` ranks' engines compute with it. A fused 2-D weight is the
    ranks' parts rank after rank along dim 0, each on a block grid of its own (a row-parallel
    weight's rows need not be whole blocks, so a part may end in a ragged block and the next
    one start a new block): each part is dequantized under its own rows of ``scale``, as
    vLLM's rank does. A 3-D weight (experts) already has one grid per leading index."""
    if fp8.dim() != 2 or tp == 1:
        return dequantize(fp8, scale, dtype)
    rows, cols = fp8.shape
    if rows % tp or scale.shape[0] % tp:
        raise ValueError(f"a weight {list(fp8.shape)}, scale {list(scale.shape)}: not {tp} parts")
    parts = dequantize(
        fp8.reshape(tp, rows // tp, cols), scale.reshape(tp, -1, scale.shape[1]), dtype
    )
    return parts.view(rows, cols)


def as_served(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named weights as an FP8 version of them serves them: each quantized weight
    quantized and dequantized back to its dtype, the rest as it is (what a trainer's own
    forward needs to score batches as the FP8 engine that sampled them)."""
    return {
        name: dequantize(*quantize(w), w.dtype) if is_quantized(name, tuple(w.shape)) else w
        for name, w in weights.items()
    }
