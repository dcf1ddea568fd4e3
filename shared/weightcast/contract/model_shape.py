"""A Qwen3 or Qwen3-MoE model's shape: the one description of it, read from and written to
its HF ``config.json``, and the HF tensors it implies (pure, no torch).

:meth:`ModelShape.from_hf_config` is the one strict reading of a ``config.json`` (it may
come from a version on disk); :meth:`ModelShape.to_hf_config` is the one writer of one (the
trainer's snapshots, the benchmarks' and the tests' models). :data:`SHAPES` names the shapes
weightcast builds itself: the trainer's own flavors and the benchmarks' real Qwen3 sizes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from weightcast.contract.errors import LayoutError

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
_DENSE_MLP = ("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class ConfigExtras:
    """The fields of ``config.json`` that the shape does not fix (no layout depends on them):
    the trainer takes them from torchtitan's args; the defaults are weightcast's ``tiny``."""

    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    eos_token_id: int | tuple[int, ...] = 1


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

    def to_hf_config(
        self, dtype: str = "bfloat16", extras: ConfigExtras = ConfigExtras()
    ) -> dict[str, Any]:
        """The ``config.json`` of HF's ``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM`` for a
        mixture of experts) of this shape, every field written out as transformers 4's
        ``save_pretrained`` names it (so that vLLM and transformers assume nothing), in the
        order the trainer's snapshots have always had."""
        config = {
            "architectures": ["Qwen3MoeForCausalLM" if self.moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if self.moe else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": extras.max_position_embeddings,
            "max_window_layers": self.num_layers,
            "rms_norm_eps": extras.rms_norm_eps,
            "rope_theta": extras.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "use_cache": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "eos_token_id": (
                list(extras.eos_token_id)
                if isinstance(extras.eos_token_id, tuple)
                else extras.eos_token_id
            ),
            "torch_dtype": dtype,
        }
        if not self.moe:
            return config
        return config | {  # no auxiliary loss: torchtitan trains without it
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }

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


def hf_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF checkpoint of ``shape`` (a tied ``lm_head`` left out, as
    ``save_pretrained`` leaves it), with its shape, layer by layer."""
    h, d, q, kv, inter = (
        shape.hidden_size,
        shape.head_dim,
        shape.q_rows,
        shape.kv_rows,
        shape.intermediate_size,
    )
    tensors: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (shape.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not shape.tie_word_embeddings:
        tensors["lm_head.weight"] = (shape.vocab_size, h)
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}"
        tensors |= {
            f"{p}.self_attn.q_proj.weight": (q, h),
            f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h),
            f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.self_attn.q_norm.weight": (d,),
            f"{p}.self_attn.k_norm.weight": (d,),
        }
        if shape.sparse(layer):
            moe = shape.moe_intermediate_size
            tensors[f"{p}.mlp.gate.weight"] = (shape.num_experts, h)
            for e in range(shape.num_experts):
                tensors |= {
                    f"{p}.mlp.experts.{e}.gate_proj.weight": (moe, h),
                    f"{p}.mlp.experts.{e}.up_proj.weight": (moe, h),
                    f"{p}.mlp.experts.{e}.down_proj.weight": (h, moe),
                }
        else:
            tensors |= {
                f"{p}.mlp.gate_proj.weight": (inter, h),
                f"{p}.mlp.up_proj.weight": (inter, h),
                f"{p}.mlp.down_proj.weight": (h, inter),
            }
        tensors |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }
        if shape.attention_bias:
            tensors |= {
                f"{p}.self_attn.q_proj.bias": (q,),
                f"{p}.self_attn.k_proj.bias": (kv,),
                f"{p}.self_attn.v_proj.bias": (kv,),
            }
    return tensors


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


_TINY = ModelShape(
    num_layers=2,
    hidden_size=128,
    intermediate_size=384,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=1024,
    tie_word_embeddings=True,
)
_QWEN3_VOCAB = 151_936

SHAPES: dict[str, ModelShape] = {
    "tiny": _TINY,
    "small": ModelShape(
        num_layers=8,
        hidden_size=1024,
        intermediate_size=3072,
        num_heads=16,
        num_kv_heads=8,
        head_dim=64,
        vocab_size=32_000,
        tie_word_embeddings=True,
    ),
    "tiny-moe": replace(
        _TINY,
        tie_word_embeddings=False,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    "0.6B": ModelShape(28, 1024, 3072, 16, 8, 128, _QWEN3_VOCAB, tie_word_embeddings=True),
    "1.7B": ModelShape(28, 2048, 6144, 16, 8, 128, _QWEN3_VOCAB, tie_word_embeddings=True),
    "8B": ModelShape(36, 4096, 12288, 32, 8, 128, _QWEN3_VOCAB, tie_word_embeddings=False),
    "30B-A3B-2L": ModelShape(
        num_layers=2,
        hidden_size=2048,
        intermediate_size=6144,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=_QWEN3_VOCAB,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
}
"""The shapes weightcast builds itself, by name.

``tiny`` trains on 2 CPU cores in milliseconds a step: GQA (2 kv heads for 4 heads) and a
head_dim (64) that is not hidden/heads (32), like the real 0.6B and 4B. ``small`` is about
133M parameters (a 0.27 GB bf16 snapshot): mid-size, and a CPU still trains it. ``tiny-moe``
is ``tiny`` untied with 8 experts of width 64, top-2 renormalised, every layer sparse, like
Qwen3-30B-A3B. ``0.6B``, ``1.7B`` and ``8B`` are Qwen3's; ``30B-A3B-2L`` is Qwen3-30B-A3B at
full width (128 experts of 768, hidden 2048, 32 heads over 4 kv heads) cut to 2 layers.
The trainer's flavors of the first three add torchtitan's own fields to these."""
