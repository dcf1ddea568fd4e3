"""The fused layout of a Qwen3-MoE's routed experts, as pure functions.

vLLM 0.32 holds each sparse layer's experts in one ``FusedMoE`` module, with two parameters
per rank (``mlp.experts.routed_experts.``):

* ``w13_weight`` ``[local experts, 2 * I_local, hidden]``: expert by expert, ``[gate rows ;
  up rows]`` of the rank's share of ``moe_intermediate_size``;
* ``w2_weight`` ``[local experts, hidden, I_local]``: the matching columns of ``down_proj``.

Its two placements over ``tp`` ranks (``FusedMoE.weight_loader``, ``determine_expert_map``):

* tensor parallel (``ep`` 1): every rank holds every expert, ``I_local = I / tp``, rank ``r``
  rows (gate, up) or columns (down) ``[r * I_local, (r + 1) * I_local)``;
* expert parallel (``enable_expert_parallel``, ``ep = tp``): the expert-parallel group spans
  the tensor-parallel ranks and experts are not split; with the default ``linear`` placement
  rank ``r`` holds experts ``[r * E / ep, (r + 1) * E / ep)`` whole. vLLM gives a remainder to
  the first ranks; weightcast refuses experts that ``ep`` does not divide (equal parts keep
  every rank's block the same shape).

The published tensor keeps vLLM's parameter name and is the concatenation along dim 0 of what
each rank's parameter holds, rank after rank (shard kind ``experts``), so a rank's bytes are
one contiguous range. The router (``mlp.gate.weight``) is replicated; dense layers
(``mlp_only_layers``) keep the dense layout.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from weightcast.contract.errors import LayoutError
from weightcast.contract.model_shape import ModelShape
from weightcast.contract.regions import (
    ColumnRange,
    Region,
    RowRange,
    expect_rows,
    join_pieces,
    take_pieces,
)
from weightcast.contract.sharding import Shard

if TYPE_CHECKING:  # torch only for unfuse_experts; the publish path runs without it
    import torch

W13 = "w13_weight"
W2 = "w2_weight"
FUSED_MOE = "mlp.experts.routed_experts"
"""Where vLLM's ``FusedMoE`` keeps its parameters, under a layer."""
_EXPERT_SOURCE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.")
_FUSED = re.compile(rf"^(model\.layers\.(\d+))\.{re.escape(FUSED_MOE)}\.({W13}|{W2})$")


@dataclass(frozen=True)
class ExpertTensor:
    """One published ``FusedMoE`` parameter: ``shape`` (3-D), and ``pieces`` whose row-major
    bytes, in order, make it (each a whole source or rows or columns of one)."""

    name: str
    shape: tuple[int, int, int]
    pieces: tuple[Region, ...]
    shard: Shard


def check_placement(shape: ModelShape, tp: int, ep: int) -> None:
    """Raise :class:`LayoutError` (one line) for a placement of the experts that vLLM would
    refuse or that weightcast does not lay out (experts that ``ep`` does not divide)."""
    if not shape.moe:
        return
    if ep not in (1, tp):
        raise LayoutError(f"ep={ep} with tp={tp}: expert parallelism spans every rank (ep {tp})")
    if tp > shape.num_experts:
        raise LayoutError(f"tp={tp} exceeds the {shape.num_experts} experts; vLLM refuses it")
    if ep > 1 and shape.num_experts % ep:
        raise LayoutError(
            f"expert parallel over {ep} ranks does not divide the {shape.num_experts} experts "
            "evenly; publish with a tp that divides them, or without expert parallelism"
        )
    if ep == 1 and shape.moe_intermediate_size % tp:
        raise LayoutError(
            f"tp={tp} does not divide moe_intermediate_size {shape.moe_intermediate_size}; "
            "vLLM refuses it (or publish with expert parallelism)"
        )


def local_experts(shape: ModelShape, ep: int, rank: int) -> range:
    """The global ids of the experts rank ``rank`` holds, in its parameter's order."""
    if ep == 1:
        return range(shape.num_experts)
    per_rank = shape.num_experts // ep
    return range(rank * per_rank, (rank + 1) * per_rank)


def intermediate_of_rank(shape: ModelShape, ep: int, tp: int, rank: int) -> tuple[int, int]:
    """The rows of ``gate``/``up`` (columns of ``down``) ``[start, stop)`` rank ``rank`` holds."""
    size = shape.moe_intermediate_size
    if ep > 1:
        return 0, size
    per_rank = size // tp
    return rank * per_rank, (rank + 1) * per_rank


def is_expert_source(name: str) -> bool:
    """An HF per-expert tensor (``mlp.experts.E.{gate,up,down}_proj.weight``)."""
    return _EXPERT_SOURCE.match(name) is not None


def fused_expert_name(name: str) -> tuple[str, int, str] | None:
    """``(layer prefix, layer, "w13_weight" | "w2_weight")`` of a published expert tensor."""
    m = _FUSED.match(name)
    return None if m is None else (m.group(1), int(m.group(2)), m.group(3))


def plan_experts(
    source_rows: Mapping[str, int], shape: ModelShape, tp: int, ep: int
) -> list[ExpertTensor]:
    """The ``w13_weight`` and ``w2_weight`` of every sparse layer, for ``tp`` ranks and
    expert parallelism ``ep`` (1 or ``tp``). ``source_rows`` maps every source tensor to its
    size along dim 0; every expert's three tensors must be there, with the config's shape."""
    check_placement(shape, tp, ep)
    h, size = shape.hidden_size, shape.moe_intermediate_size
    per_rank = shape.num_experts // ep
    lo, hi = intermediate_of_rank(shape, ep, tp, 0)
    local = hi - lo
    planned: list[ExpertTensor] = []
    for layer in range(shape.num_layers):
        if not shape.sparse(layer):
            continue
        prefix = f"model.layers.{layer}"
        w13: list[Region] = []
        w2: list[Region] = []
        for rank in range(tp):
            lo, hi = intermediate_of_rank(shape, ep, tp, rank)
            for expert in local_experts(shape, ep, rank):
                gate, up, down = (
                    f"{prefix}.mlp.experts.{expert}.{p}_proj.weight" for p in ("gate", "up", "down")
                )
                expect_rows(source_rows, {gate: size, up: size, down: h})
                w13 += [RowRange(gate, lo, hi), RowRange(up, lo, hi)]
                w2.append(RowRange(down, 0, h) if ep > 1 else ColumnRange(down, lo, hi, h))
        shard = Shard.expert_block(tp, ep, per_rank)
        rows = tp * per_rank
        planned += [
            ExpertTensor(f"{prefix}.{FUSED_MOE}.{W13}", (rows, 2 * local, h), tuple(w13), shard),
            ExpertTensor(f"{prefix}.{FUSED_MOE}.{W2}", (rows, h, local), tuple(w2), shard),
        ]
    return planned


def source_rows_of(shape: ModelShape) -> dict[str, int]:
    """Every HF expert tensor of ``shape``'s sparse layers, with its size along dim 0."""
    h, size = shape.hidden_size, shape.moe_intermediate_size
    return {
        f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight": rows
        for layer in range(shape.num_layers)
        if shape.sparse(layer)
        for expert in range(shape.num_experts)
        for proj, rows in (("gate", size), ("up", size), ("down", h))
    }


def placement_of(rows: int, shape: ModelShape, tp: int) -> int:
    """The ``ep`` of a published ``w13_weight`` / ``w2_weight`` with ``rows`` experts' rows
    (``tp * E`` with ep 1, ``E`` with ep ``tp``). Raises :class:`LayoutError`."""
    if rows == tp * shape.num_experts:
        return 1
    if rows == shape.num_experts:
        return tp
    raise LayoutError(
        f"a FusedMoE parameter with {rows} experts' rows fits no placement of "
        f"{shape.num_experts} experts over tp={tp}"
    )


def unfuse_experts(
    tensors: Mapping[str, torch.Tensor], shape: ModelShape, tp: int
) -> dict[str, torch.Tensor]:
    """Invert :func:`plan_experts`: the HF ``mlp.experts.E.{gate,up,down}_proj.weight`` behind
    published ``w13_weight`` / ``w2_weight`` (``tensors``: those, and only those). The
    placement is read from their rows (:func:`placement_of`). Raises :class:`LayoutError`
    for a missing, extra or misshapen one."""
    if not tensors:
        return {}
    ep = placement_of(tensors[min(tensors)].shape[0], shape, tp)
    planned = plan_experts(source_rows_of(shape), shape, tp, ep)
    if extra := sorted(set(tensors) - {p.name for p in planned}):
        raise LayoutError(f"{extra[0]} is no FusedMoE parameter of this config's sparse layers")
    sources: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int] = {}
    for plan in planned:
        data = tensors.get(plan.name)
        if data is None:
            raise LayoutError(f"{plan.name} is missing")
        if tuple(data.shape) != plan.shape:
            raise LayoutError(
                f"{plan.name} has shape {tuple(data.shape)}; tp={tp}, ep={ep} implies {plan.shape}"
            )
        # [experts, a, b] -> [experts * a, b]: the pieces, one after another along dim 0
        take_pieces(data.reshape(-1, plan.shape[2]), plan.pieces, sources, dims)
    return join_pieces(sources, dims)
