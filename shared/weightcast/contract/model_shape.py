"""A Qwen3 or Qwen3-MoE model's shape, read from its HF ``config.json``, and the HF tensors
it implies (pure, no torch).

:meth:`ModelShape.from_hf_config` is the one strict reading of a ``config.json`` (it may
come from a version on disk).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightcast.contract.errors import LayoutError

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
_DENSE_MLP = ("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Qwen3 (or Qwen3-MoE) that the layouts depend on."""

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
    if name in VOCAB_TENSORS:
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
