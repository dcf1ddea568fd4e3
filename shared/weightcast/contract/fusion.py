"""The vllm-fused layout as pure functions.

vLLM shards a Qwen3 attention block with ``QKVParallelLinear`` and the MLP with
``MergedColumnParallelLinear``. For tensor-parallel degree ``tp`` the fused tensor is the
concatenation, over ranks ``r = 0..tp-1``, of the block rank ``r`` holds:

* ``qkv_proj``: ``[q heads of r ; k head(s) of r ; v head(s) of r]``. With ``tp <= kv heads``
  each rank owns ``kv_heads / tp`` kv heads; with ``tp > kv heads`` vLLM replicates them and
  rank ``r`` holds kv head ``r // (tp / kv_heads)``, so the tensor has
  ``q_rows + 2 * tp * head_dim`` rows.
* ``gate_up_proj``: ``[gate rows of r ; up rows of r]``.
* ``o_proj`` / ``down_proj`` (``RowParallelLinear``, split along its input columns): each
  rank's columns ``[:, r * c : (r + 1) * c]`` (``c = columns / tp``), rank after rank along
  dim 0, a ``[tp * rows, c]`` tensor in which each rank's part is contiguous (manifest format
  3; formats 1 and 2 stored the HF tensor, so a rank read every row for its columns).

Every fused tensor is a list of row ranges (:class:`RowRange`) or column ranges
(:class:`ColumnRange`) of the HF source tensors, so a conversion is a re-ordering of
row-major byte ranges; :func:`assemble` materialises it.
Everything else keeps its HF name and value, and a tied ``lm_head`` is not written twice.
:func:`unfuse` inverts the layout, for readers that want HF tensors back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weightcast.contract.errors import LayoutError
from weightcast.contract.sharding import Shard, ShardKind

if TYPE_CHECKING:  # torch only for assemble/unfuse; the publish path runs without it
    import torch

_QKV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.q_proj\.(weight|bias)$")
_GATE = re.compile(r"^(model\.layers\.\d+\.mlp)\.gate_proj\.(weight|bias)$")
_FUSED_QKV = re.compile(r"^(model\.layers\.\d+\.self_attn)\.qkv_proj\.(weight|bias)$")
_FUSED_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp)\.gate_up_proj\.(weight|bias)$")
_FUSED_PART = re.compile(r"\.(k_proj|v_proj|up_proj)\.(weight|bias)$")
_ROW_PARALLEL = re.compile(r"\.(o_proj|down_proj)\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_DENSE_MLP = ("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a dense Qwen3 that the layout depends on, read from its HF config."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    num_experts: int = 0
    """Routed experts of each sparse layer (0: a dense Qwen3)."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP in a mixture of experts."""
    norm_topk_prob: bool = False

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """Read a ``config.json`` dict; head_dim comes from the config, never hidden/heads.

        The dict may come from a version on disk: every number must be a positive integer
        and every flag a boolean, or a :class:`LayoutError` names the field.
        """
        heads = _config_number(config, "num_attention_heads")
        hidden = _config_number(config, "hidden_size")
        layers = _config_number(config, "num_hidden_layers")
        return cls(
            num_layers=layers,
            hidden_size=hidden,
            intermediate_size=_config_number(config, "intermediate_size"),
            num_heads=heads,
            num_kv_heads=_config_number(config, "num_key_value_heads", heads),
            head_dim=_config_number(config, "head_dim", hidden // heads),
            vocab_size=_config_number(config, "vocab_size"),
            tie_word_embeddings=_config_flag(config, "tie_word_embeddings"),
            attention_bias=_config_flag(config, "attention_bias"),
            **_moe_fields(config, layers),
        )

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def sparse(self, layer: int) -> bool:
        """Whether ``layer`` has routed experts (vLLM's and transformers' rule)."""
        return (
            self.moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def q_rows(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.num_kv_heads * self.head_dim


def _config_number(config: Mapping[str, Any], name: str, default: int | None = None) -> int:
    """A positive integer of ``config.json``; ``default`` stands in for a null or 0."""
    value = config.get(name)
    if default is not None and (value is None or (type(value) is int and value == 0)):
        return default
    if value is None:
        raise LayoutError(f"config.json lacks {name!r}")
    if type(value) is not int or value < 1:
        raise LayoutError(f"config.json: {name} is {value!r}, not a positive integer")
    return value


_MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
"""What transformers' ``Qwen3MoeConfig`` (and so vLLM) assumes for a field left out."""


def _moe_fields(config: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE ``config.json`` (none for a dense one),
    the one reading of them (the trainer's ``hf_start`` takes them from :class:`ModelShape`).

    Qwen's own configs name the expert count ``num_experts``; transformers 5 writes
    ``num_local_experts``. Either, or ``model_type`` ``qwen3_moe``, makes the config a MoE one;
    fields left out take ``Qwen3MoeConfig``'s defaults, as vLLM's engine does.
    """
    named = {"num_experts", "num_local_experts"} & set(config)
    if not named and config.get("model_type") != "qwen3_moe":
        return {}
    fields = {name: config.get(name, default) for name, default in _MOE_DEFAULTS.items()}
    if "num_local_experts" in config:
        local = config["num_local_experts"]
        if "num_experts" in config and local != config["num_experts"]:
            raise LayoutError(
                f"config.json: num_local_experts {local!r} and num_experts "
                f"{config['num_experts']!r} differ"
            )
        fields["num_experts"] = local
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        _moe_number(fields, name)
    _moe_number(fields, "decoder_sparse_step")
    if type(fields["norm_topk_prob"]) is not bool:
        raise LayoutError(
            f"config.json: norm_topk_prob is {fields['norm_topk_prob']!r}, not true or false"
        )
    experts, top_k = fields["num_experts"], fields["num_experts_per_tok"]
    if top_k > experts:
        raise LayoutError(
            f"config.json: num_experts_per_tok {top_k} is more than num_experts {experts}"
        )
    listed = fields["mlp_only_layers"]
    if not isinstance(listed, list) or not all(type(i) is int for i in listed):
        raise LayoutError(
            f"config.json: mlp_only_layers is {listed!r}, not a list of layer indices"
        )
    outside = [i for i in listed if not 0 <= i < layers]
    if outside:
        raise LayoutError(
            f"config.json: mlp_only_layers names layer {outside[0]}; the model's layers are "
            f"0 to {layers - 1}"
        )
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": fields["moe_intermediate_size"],
        "decoder_sparse_step": fields["decoder_sparse_step"],
        "mlp_only_layers": tuple(sorted(set(listed))),
        "norm_topk_prob": fields["norm_topk_prob"],
    }


def _moe_number(fields: Mapping[str, Any], name: str) -> None:
    value = fields[name]
    if type(value) is not int or value < 1:
        raise LayoutError(f"config.json: {name} is {value!r}, not a positive integer")


def _config_flag(config: Mapping[str, Any], name: str) -> bool:
    value = config.get(name)
    if value is None:
        return False
    if type(value) is not bool:
        raise LayoutError(f"config.json: {name} is {value!r}, not true or false")
    return value


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` along dim 0 of the source tensor ``source``."""

    source: str
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ColumnRange:
    """Columns ``[start, stop)`` of all ``rows`` rows of the 2-D source tensor ``source``."""

    source: str
    start: int
    stop: int
    rows: int


Region = RowRange | ColumnRange


@dataclass(frozen=True)
class FusedTensor:
    """One output tensor: the concatenation of ``pieces`` along dim 0.

    ``shard`` says how vLLM splits it over tensor-parallel ranks (it goes into the manifest).
    """

    name: str
    pieces: tuple[Region, ...]
    shard: Shard

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)


def check_tp(shape: ModelShape, tp: int) -> None:
    """Raise :class:`LayoutError` for a tp that vLLM itself would refuse for this model."""
    if tp < 1:
        raise LayoutError(f"tp must be >= 1, got {tp}")
    if shape.num_heads % tp:
        raise LayoutError(
            f"tp={tp} does not divide the {shape.num_heads} attention heads; vLLM refuses it"
        )
    kv = shape.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise LayoutError(
            f"tp={tp} and {kv} kv heads: one must divide the other or vLLM refuses it"
        )
    if shape.intermediate_size % tp:
        raise LayoutError(
            f"tp={tp} does not divide intermediate_size {shape.intermediate_size}; vLLM refuses it"
        )


def expected_shape(name: str, shape: ModelShape) -> tuple[int, ...] | None:
    """The shape a Qwen3 tensor named ``name`` must have, or None for names not known here.

    Raises :class:`LayoutError` for a layer the config does not have.
    """
    h, d, q, kv, inter = (
        shape.hidden_size,
        shape.head_dim,
        shape.q_rows,
        shape.kv_rows,
        shape.intermediate_size,
    )
    if name in _VOCAB:
        return (shape.vocab_size, h)
    if name == "model.norm.weight":
        return (h,)
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= shape.num_layers:
        raise LayoutError(f"{name}: the config has only {shape.num_layers} layers")
    if shape.sparse(layer):
        if rest.startswith(_DENSE_MLP):
            raise LayoutError(f"{name}: layer {layer} has experts, not a dense MLP")
        if rest == "mlp.gate.weight":
            return (shape.num_experts, h)
        if e := _EXPERT.match(rest):
            if int(e.group(1)) >= shape.num_experts:
                raise LayoutError(f"{name}: the config has only {shape.num_experts} experts")
            moe = shape.moe_intermediate_size
            return (h, moe) if e.group(2) == "down_proj" else (moe, h)
    elif rest.startswith(("mlp.gate.", "mlp.experts.")):
        raise LayoutError(f"{name}: layer {layer} is dense (no experts)")
    known = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    return known.get(rest)


def check_shapes(shapes: Mapping[str, Sequence[int]], shape: ModelShape) -> None:
    """Raise :class:`LayoutError` naming the first tensor whose shape the config contradicts."""
    for name, size in shapes.items():
        expected = expected_shape(name, shape)
        if expected is not None and tuple(size) != expected:
            raise LayoutError(f"{name} has shape {list(size)}; the config implies {list(expected)}")
    if "model.embed_tokens.weight" not in shapes:
        raise LayoutError("model.embed_tokens.weight is missing from the snapshot")
    if not shape.tie_word_embeddings and "lm_head.weight" not in shapes:
        raise LayoutError("lm_head.weight is missing and the config does not tie it")


def kv_head_of_rank(shape: ModelShape, tp: int, rank: int) -> tuple[int, int]:
    """The kv heads ``[first, first + count)`` that tensor-parallel rank ``rank`` holds."""
    if tp >= shape.num_kv_heads:
        replicas = tp // shape.num_kv_heads
        return rank // replicas, 1
    per_rank = shape.num_kv_heads // tp
    return rank * per_rank, per_rank


def qkv_pieces(shape: ModelShape, tp: int, q: str, k: str, v: str) -> tuple[RowRange, ...]:
    """Row ranges of q, k, v that make the fused ``qkv_proj`` for ``tp`` ranks."""
    check_tp(shape, tp)
    q_per_rank = shape.q_rows // tp
    pieces: list[RowRange] = []
    for rank in range(tp):
        first, count = kv_head_of_rank(shape, tp, rank)
        kv_start, kv_stop = first * shape.head_dim, (first + count) * shape.head_dim
        pieces += [
            RowRange(q, rank * q_per_rank, (rank + 1) * q_per_rank),
            RowRange(k, kv_start, kv_stop),
            RowRange(v, kv_start, kv_stop),
        ]
    return tuple(pieces)


def gate_up_pieces(shape: ModelShape, tp: int, gate: str, up: str) -> tuple[RowRange, ...]:
    """Row ranges of gate and up that make the fused ``gate_up_proj`` for ``tp`` ranks."""
    check_tp(shape, tp)
    per_rank = shape.intermediate_size // tp
    pieces: list[RowRange] = []
    for rank in range(tp):
        rows = (rank * per_rank, (rank + 1) * per_rank)
        pieces += [RowRange(gate, *rows), RowRange(up, *rows)]
    return tuple(pieces)


def plan_vllm_fused(
    source_rows: Mapping[str, int], shape: ModelShape, tp: int
) -> list[FusedTensor]:
    """Plan the vllm-fused layout of an HF-named state dict.

    ``source_rows`` maps each source tensor name to its size along dim 0. Returns the output
    tensors in the order they should be written. Raises :class:`LayoutError` when a tensor the
    fusion needs is missing or has the wrong number of rows.
    """
    check_tp(shape, tp)
    planned: list[FusedTensor] = []
    consumed: set[str] = set()
    for name in source_rows:
        if m := _QKV.match(name):
            prefix, kind = m.groups()
            q, k, v = (f"{prefix}.{p}_proj.{kind}" for p in "qkv")
            expect_rows(source_rows, {q: shape.q_rows, k: shape.kv_rows, v: shape.kv_rows})
            q_per_rank = shape.q_rows // tp
            kv_per_rank = kv_head_of_rank(shape, tp, 0)[1] * shape.head_dim
            planned.append(
                FusedTensor(
                    f"{prefix}.qkv_proj.{kind}",
                    qkv_pieces(shape, tp, q, k, v),
                    Shard.qkv(tp, q_per_rank, kv_per_rank),
                )
            )
            consumed.update((q, k, v))
        elif m := _GATE.match(name):
            prefix, kind = m.groups()
            gate, up = f"{prefix}.gate_proj.{kind}", f"{prefix}.up_proj.{kind}"
            expect_rows(source_rows, {gate: shape.intermediate_size, up: shape.intermediate_size})
            per_rank = shape.intermediate_size // tp
            planned.append(
                FusedTensor(
                    f"{prefix}.gate_up_proj.{kind}",
                    gate_up_pieces(shape, tp, gate, up),
                    Shard.gate_up(tp, per_rank),
                )
            )
            consumed.update((gate, up))
    for name, rows in source_rows.items():
        if name in consumed or (name == "lm_head.weight" and shape.tie_word_embeddings):
            continue
        if _FUSED_PART.search(name):
            raise LayoutError(f"{name} has no partner to fuse with (q_proj / gate_proj missing)")
        if _ROW_PARALLEL.search(name):
            planned.append(_row_parallel(name, rows, shape, tp))
        else:
            planned.append(FusedTensor(name, (RowRange(name, 0, rows),), _unfused_shard(name)))
    return sorted(planned, key=lambda t: natural_key(t.name))


def _row_parallel(name: str, rows: int, shape: ModelShape, tp: int) -> FusedTensor:
    """``o_proj`` / ``down_proj``: each rank's input columns, rank after rank (one piece of
    whole rows at tp 1, the same bytes)."""
    known = expected_shape(name, shape)
    if known is None or rows != known[0]:
        raise LayoutError(f"{name} has {rows} rows; the config implies {known and known[0]}")
    shard = Shard.row_parallel_ranks(tp, rows)
    if tp == 1:
        return FusedTensor(name, (RowRange(name, 0, rows),), shard)
    per_rank = known[1] // tp
    pieces = tuple(ColumnRange(name, r * per_rank, (r + 1) * per_rank, rows) for r in range(tp))
    return FusedTensor(name, pieces, shard)


def assemble(tensor: FusedTensor, sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Materialise ``tensor`` from the source tensors it is made of.

    A tensor made of one whole source is that source itself (no copy); treat it as read-only.
    """
    import torch

    parts = [
        sources[p.source][:, p.start : p.stop]
        if isinstance(p, ColumnRange)
        else sources[p.source][p.start : p.stop]
        for p in tensor.pieces
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def unfuse(
    tensors: Mapping[str, torch.Tensor], shape: ModelShape, tp: int
) -> dict[str, torch.Tensor]:
    """Invert the layout: the HF-named tensors behind published vllm-fused ones.

    Replicated kv heads appear once per replica; the copies must agree. A tied ``lm_head``
    stays absent, as in HF checkpoints. A row-parallel tensor of a format 1 or 2 version
    (stored as the HF tensor: ``[rows, columns]``, where format 3 has ``[tp * rows, c]``) is
    taken as it is. A mixture of experts' ``FusedMoE`` parameters give back each expert's
    ``gate_proj`` / ``up_proj`` / ``down_proj``
    (:func:`~weightcast.contract.experts.unfuse_experts`).
    """
    # experts.py builds on this module, so it is imported here, not at the top
    from weightcast.contract.experts import fused_expert_name, unfuse_experts

    experts = {n: t for n, t in tensors.items() if fused_expert_name(n) is not None}
    source_rows: dict[str, int] = {}
    for name, tensor in tensors.items():
        if name in experts:
            continue
        if m := _FUSED_QKV.match(name):
            prefix, kind = m.groups()
            source_rows |= {
                f"{prefix}.q_proj.{kind}": shape.q_rows,
                f"{prefix}.k_proj.{kind}": shape.kv_rows,
                f"{prefix}.v_proj.{kind}": shape.kv_rows,
            }
        elif m := _FUSED_GATE_UP.match(name):
            prefix, kind = m.groups()
            source_rows |= {
                f"{prefix}.gate_proj.{kind}": shape.intermediate_size,
                f"{prefix}.up_proj.{kind}": shape.intermediate_size,
            }
        elif _ROW_PARALLEL.search(name) and (known := expected_shape(name, shape)):
            source_rows[name] = known[0]
        else:
            source_rows[name] = tensor.shape[0]
    sources: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int] = {}
    for plan in plan_vllm_fused(source_rows, shape, tp):
        data = tensors[plan.name]
        old_format = _ROW_PARALLEL.search(plan.name) and data.shape[0] != plan.rows
        if old_format and tuple(data.shape) == expected_shape(plan.name, shape):
            sources[plan.name] = {0: data}  # format 1 or 2: the HF tensor itself
            continue
        if data.shape[0] != plan.rows:
            raise LayoutError(f"{plan.name} has {data.shape[0]} rows; tp={tp} implies {plan.rows}")
        take_pieces(data, plan.pieces, sources, dims)
    return join_pieces(sources, dims) | unfuse_experts(experts, shape, tp)


def take_pieces(
    data: torch.Tensor,
    pieces: Sequence[Region],
    sources: dict[str, dict[int, torch.Tensor]],
    dims: dict[str, int],
) -> None:
    """Cut ``data`` (2-D: the concatenation of ``pieces`` along dim 0) back into its pieces,
    into ``sources[source][start]``; ``dims[source]`` is the dim :func:`join_pieces` joins
    them along. Raises :class:`LayoutError` where two replicas of one piece disagree."""
    import torch

    offset = 0
    for piece in pieces:
        block = data[offset : offset + piece.rows]
        offset += piece.rows
        dims[piece.source] = 1 if isinstance(piece, ColumnRange) else 0
        seen = sources.setdefault(piece.source, {})
        if piece.start in seen and not torch.equal(seen[piece.start], block):
            raise LayoutError(f"replicas of {piece.source} rows {piece.start}.. disagree")
        seen[piece.start] = block


def join_pieces(
    sources: Mapping[str, Mapping[int, torch.Tensor]], dims: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """Each source tensor from the pieces :func:`take_pieces` cut, in order of their start."""
    import torch

    return {
        name: torch.cat([block for _, block in sorted(blocks.items())], dim=dims.get(name, 0))
        for name, blocks in sources.items()
    }


def _unfused_shard(name: str) -> Shard:
    if name in _VOCAB:
        return Shard(ShardKind.VOCAB_PARALLEL)
    return Shard(ShardKind.REPLICATED)


def expect_rows(source_rows: Mapping[str, int], expected: Mapping[str, int]) -> None:
    """Raise :class:`LayoutError` unless every source is there with the rows it must have."""
    for name, rows in expected.items():
        if name not in source_rows:
            raise LayoutError(f"{name} is missing from the snapshot")
        if source_rows[name] != rows:
            raise LayoutError(f"{name} has {source_rows[name]} rows; the config implies {rows}")


def natural_key(name: str) -> list[Any]:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
