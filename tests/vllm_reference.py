"""What vLLM places on one tensor-parallel rank, computed the way vLLM's loaders do it.

This mirrors ``QKVParallelLinear.weight_loader`` and ``MergedColumnParallelLinear.weight_loader``
(vllm/model_executor/layers/linear.py) fed the HF tensors q, k, v (gate, up) one shard id at a
time. It is deliberately independent of ``weightcast.contract.fusion`` and ``sharding``: the
tests compare the two.
"""

from __future__ import annotations

import torch


def qkv_parallel_rank(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    total_num_heads: int,
    total_num_kv_heads: int,
    head_size: int,
    tp_size: int,
    tp_rank: int,
) -> torch.Tensor:
    assert total_num_heads % tp_size == 0
    num_heads = total_num_heads // tp_size
    if tp_size >= total_num_kv_heads:
        assert tp_size % total_num_kv_heads == 0
        num_kv_heads, num_kv_head_replicas = 1, tp_size // total_num_kv_heads
    else:
        assert total_num_kv_heads % tp_size == 0
        num_kv_heads, num_kv_head_replicas = total_num_kv_heads // tp_size, 1
    param = torch.full(
        ((num_heads + 2 * num_kv_heads) * head_size, *q.shape[1:]), float("nan"), dtype=q.dtype
    )
    for shard_id, loaded in (("q", q), ("k", k), ("v", v)):
        if shard_id == "q":
            shard_offset, shard_size = 0, num_heads * head_size
        elif shard_id == "k":
            shard_offset, shard_size = num_heads * head_size, num_kv_heads * head_size
        else:
            shard_offset = (num_heads + num_kv_heads) * head_size
            shard_size = num_kv_heads * head_size
        shard_rank = tp_rank if shard_id == "q" else tp_rank // num_kv_head_replicas
        target = param.narrow(0, shard_offset, shard_size)
        target.copy_(loaded.narrow(0, shard_rank * shard_size, shard_size))
    return param


def merged_column_parallel_rank(
    gate: torch.Tensor, up: torch.Tensor, tp_size: int, tp_rank: int
) -> torch.Tensor:
    output_sizes = [gate.shape[0], up.shape[0]]
    param = torch.full(
        (sum(output_sizes) // tp_size, *gate.shape[1:]), float("nan"), dtype=gate.dtype
    )
    for shard_id, loaded in enumerate((gate, up)):
        shard_offset = sum(output_sizes[:shard_id]) // tp_size
        shard_size = output_sizes[shard_id] // tp_size
        param.narrow(0, shard_offset, shard_size).copy_(
            loaded.narrow(0, tp_rank * shard_size, shard_size)
        )
    return param


def vocab_parallel_rank(
    weight: torch.Tensor, tp_size: int, tp_rank: int, padding_size: int = 64
) -> torch.Tensor:
    """``VocabParallelEmbedding.weight_loader``: the rank's rows of the padded vocabulary,
    padding rows left zero (vllm/model_executor/layers/vocab_parallel_embedding.py)."""
    org_vocab = weight.shape[0]
    padded = ((org_vocab + padding_size - 1) // padding_size) * padding_size
    per_partition = padded // tp_size
    start = min(tp_rank * per_partition, org_vocab)
    end = min((tp_rank + 1) * per_partition, org_vocab)
    param = torch.zeros((per_partition, *weight.shape[1:]), dtype=weight.dtype)
    param[: end - start].copy_(weight[start:end])
    return param


def row_parallel_rank(weight: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """``RowParallelLinear.weight_loader``: input_dim 1, split evenly over ranks."""
    shard_size = weight.shape[1] // tp_size
    return weight.narrow(1, tp_rank * shard_size, shard_size).clone()


def fused_moe_rank(
    gates: list[torch.Tensor],
    ups: list[torch.Tensor],
    downs: list[torch.Tensor],
    tp_size: int,
    tp_rank: int,
    expert_parallel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w13_weight, w2_weight)`` of one rank, as ``FusedMoE.weight_loader`` fills them.

    Expert parallel: ``determine_expert_map``'s linear placement over ``tp_size`` ranks, each
    expert whole. Otherwise every expert, ``_load_w13`` narrowing gate and up (dim 0) and
    ``_load_w2`` narrowing down (dim 1) to the rank's share.
    """
    experts = len(gates)
    if expert_parallel:
        base, remainder = divmod(experts, tp_size)
        count = base + (tp_rank < remainder)
        first = tp_rank * base + min(tp_rank, remainder)
        local, moe_tp, moe_rank = range(first, first + count), 1, 0
    else:
        local, moe_tp, moe_rank = range(experts), tp_size, tp_rank
    w13, w2 = [], []
    for e in local:
        per_rank = gates[e].shape[0] // moe_tp
        rows = slice(moe_rank * per_rank, (moe_rank + 1) * per_rank)
        w13.append(torch.cat([gates[e][rows], ups[e][rows]]))
        w2.append(downs[e][:, rows])
    return torch.stack(w13), torch.stack(w2)


def fp8_block_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The published Qwen3 FP8 format from its definition, one 128 x 128 block at a time, as
    vLLM's reference quantizer (``per_block_cast_to_fp8``) states it: ``scale = max(amax,
    1e-4) / 448`` in float32, ``fp8 = (x * (1 / scale)).to(float8_e4m3fn)``; returns the
    ``float8_e4m3fn`` weight and its float32 ``weight_scale_inv``."""
    rows, cols = weight.shape
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // 128), -(-cols // 128))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            at = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            block = weight[at].float()
            scale = torch.tensor(max(block.abs().max().item(), 1e-4), dtype=torch.float32) / 448
            scales[i, j] = scale
            out[at] = (block * (1 / scale)).to(torch.float8_e4m3fn)
    return out, scales
