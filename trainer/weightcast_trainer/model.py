"""The Qwen3 policy: flavors, the torchtitan train spec, and the model's HF ``config.json``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torchtitan.experiments.forge import train_spec as forge_specs
from torchtitan.models.moe import MoE, MoEArgs
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs
from torchtitan.models.qwen3.model.model import TransformerBlock

from weightcast.contract.model_shape import SHAPES, ConfigExtras, ModelShape

TRAIN_SPEC_NAME = "weightcast_qwen3"
START_FLAVOR = "init-from"
"""The flavor a run started from a checkpoint trains: that checkpoint's own shape."""


def qwen3_moe_router(num_experts: int, top_k: int, norm_topk_prob: bool) -> MoEArgs:
    """torchtitan's MoE args for HF's Qwen3-MoE router, as torchtitan's own Qwen3 MoE
    flavors set them: softmax scores in fp32, the top-k renormalised when
    ``norm_topk_prob``, no shared expert, the scores applied to the experts' outputs.

    ``load_balance_coeff`` is None: torchtitan 0.2.0's Qwen3 spec builds its optimizers
    without the MoE load-balancing hook, so its ``expert_bias`` stays zero anyway, and HF's
    Qwen3-MoE (and vLLM's) has no such bias: a trained one could not be published, and the
    engine would route other than the trainer did.
    """
    return MoEArgs(
        num_experts=num_experts,
        num_shared_experts=0,
        score_func="softmax",
        route_norm=norm_topk_prob,
        route_scale=1.0,
        score_before_experts=False,
        top_k=top_k,
        load_balance_coeff=None,
    )


@dataclasses.dataclass
class Qwen3MoeModelArgs(Qwen3ModelArgs):
    """torchtitan's Qwen3 args and the layers of an MoE that stay dense (HF's
    ``mlp_only_layers``, and those ``decoder_sparse_step`` skips): torchtitan decides per
    block, but its Qwen3 args make every block alike."""

    dense_layers: tuple[int, ...] = ()


def with_experts(args: Qwen3ModelArgs, **moe: Any) -> Qwen3MoeModelArgs:
    """``args`` as an MoE's, with the fields ``moe`` gives."""
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return Qwen3MoeModelArgs(**(fields | moe))


def qwen3_args(
    shape: ModelShape,
    max_seq_len: int,
    rope_theta: float = 1_000_000,
    norm_eps: float = 1e-6,
    eos_id: int = 1,
) -> Qwen3ModelArgs:
    """torchtitan's Qwen3 (Qwen3-MoE) args of ``shape``: its numbers from :class:`ModelShape`,
    the one description of a model's shape; the rest are torchtitan's own fields. The layers
    without experts (``mlp_only_layers``, those ``decoder_sparse_step`` skips) are dense."""
    args = Qwen3ModelArgs(
        vocab_size=shape.vocab_size,
        max_seq_len=max_seq_len,
        head_dim=shape.head_dim,
        dim=shape.hidden_size,
        n_layers=shape.num_layers,
        n_heads=shape.num_heads,
        n_kv_heads=shape.num_kv_heads,
        qk_norm=True,
        hidden_dim=shape.intermediate_size,
        norm_eps=norm_eps,
        rope_theta=rope_theta,
        enable_weight_tying=shape.tie_word_embeddings,
        eos_id=eos_id,
    )
    if not shape.moe:
        return args
    return with_experts(
        args,
        moe_enabled=True,
        moe_inter_dim=shape.moe_intermediate_size,
        moe_args=qwen3_moe_router(
            shape.num_experts, shape.num_experts_per_tok, shape.norm_topk_prob
        ),
        dense_layers=tuple(i for i in range(shape.num_layers) if not shape.sparse(i)),
    )


def shape_of(args: Qwen3ModelArgs) -> ModelShape:
    """The :class:`ModelShape` of torchtitan's args (:func:`qwen3_args` inverted; an MoE's
    dense layers listed as ``mlp_only_layers``)."""
    moe: dict[str, Any] = {}
    if args.moe_enabled:
        router = args.moe_args  # as qwen3_moe_router sets it, for every flavor and start
        moe = {
            "num_experts": router.num_experts,
            "num_experts_per_tok": router.top_k,
            "moe_intermediate_size": args.moe_inter_dim,
            "mlp_only_layers": tuple(sorted(getattr(args, "dense_layers", ()))),
            "norm_topk_prob": router.route_norm,
        }
    return ModelShape(
        num_layers=args.n_layers,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_heads=args.n_heads,
        num_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        tie_word_embeddings=args.enable_weight_tying,
        **moe,
    )


TINY = qwen3_args(SHAPES["tiny"], max_seq_len=1024)
SMALL = qwen3_args(SHAPES["small"], max_seq_len=2048)
TINY_MOE = qwen3_args(SHAPES["tiny-moe"], max_seq_len=1024)
"""weightcast's own flavors: the shapes of :data:`~weightcast.contract.model_shape.SHAPES`
(``tiny`` trains on 2 CPU cores in milliseconds a step, ``tiny-moe`` in about a second a step
of 256 tokens, ``small`` is a mid-size model that a CPU still trains)."""


class TiedQwen3Model(Qwen3Model):
    """torchtitan's Qwen3 with weight tying that survives materialisation, and an MoE that
    runs on a CPU.

    torchtitan 0.2.0 ties ``output`` to ``tok_embeddings`` in ``parallelize_qwen3``, but
    without FSDP the later ``to_empty`` gives each its own storage, and the two drift apart.
    Tying again in ``init_weights`` (which runs after ``to_empty`` and before the optimizer
    is built) keeps one parameter in every parallelism. An MoE's ``dense_layers``
    (:class:`Qwen3MoeModelArgs`) are torchtitan's dense blocks, its others' MoE layers are
    :class:`CpuCountingMoE`.
    """

    def __init__(self, model_args: Qwen3ModelArgs) -> None:
        super().__init__(model_args)
        dense = dataclasses.replace(model_args, moe_enabled=False)
        for layer in getattr(model_args, "dense_layers", ()):
            self.layers[str(layer)] = TransformerBlock(layer, dense)
        for block in self.layers.values():
            if block.moe_enabled:
                block.moe.__class__ = CpuCountingMoE  # same state, one method more

    def init_weights(self, buffer_device: Any = None) -> None:
        if self.model_args.enable_weight_tying:
            self.output.weight = self.tok_embeddings.weight
        super().init_weights(buffer_device)


class CpuCountingMoE(MoE):
    """torchtitan's MoE layer, runnable on a CPU: its router counts the tokens of each
    expert with ``torch.histc`` of their int64 indices, which CPUs do not implement; there
    :class:`IntegerHistc` counts them. In the layer's own forward, so that activation
    checkpointing's recomputation in the backward pass counts the same way."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return super().forward(x)
        with IntegerHistc():
            return super().forward(x)


class IntegerHistc(TorchFunctionMode):
    """``torch.histc(indices, bins=n, min=0, max=n)`` of integer indices as
    ``torch.bincount(indices, minlength=n)``: the same counts, in the indices' dtype as a
    GPU's ``histc`` gives them (a CPU's has no integer kernel). Every other call runs as is."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.histc and not args[0].is_floating_point():
            bins = kwargs.get("bins", args[1] if len(args) > 1 else 100)
            low, high = kwargs.get("min", 0), kwargs.get("max", bins)
            if (low, high) == (0, bins):
                return torch.bincount(args[0].reshape(-1), minlength=bins)
        return func(*args, **kwargs)


def flavors() -> dict[str, Qwen3ModelArgs]:
    """Every Qwen3 flavor: ``tiny``, ``small``, ``tiny-moe`` and torchtitan's (dense 0.6B ...
    32B; MoE ``debugmodel_moe``, ``30B-A3B``, ``235B-A22B`` with the router of
    :func:`qwen3_moe_router`)."""
    base = forge_specs.get_train_spec("qwen3").model_args
    titan = {name: _hf_router(args) for name, args in base.items()}
    return {"tiny": TINY, "small": SMALL, "tiny-moe": TINY_MOE, **titan}


def _hf_router(args: Qwen3ModelArgs) -> Qwen3ModelArgs:
    """torchtitan's flavor with the router HF's Qwen3-MoE has (a dense one unchanged)."""
    if not args.moe_enabled:
        return args
    moe = args.moe_args
    return with_experts(args, moe_args=qwen3_moe_router(moe.num_experts, moe.top_k, moe.route_norm))


def flavor_args(name: str) -> Qwen3ModelArgs:
    """A private copy of a flavor's args (torchtitan mutates the registered ones)."""
    available = flavors()
    if name not in available:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(available)}")
    return copy.deepcopy(available[name])


def register_train_spec(start: Qwen3ModelArgs | None = None) -> None:
    """Register ``weightcast_qwen3`` with ForgeEngine: torchtitan's qwen3 spec, our flavors,
    and (as :data:`START_FLAVOR`) the shape of the checkpoint a run starts from."""
    base = forge_specs.get_train_spec("qwen3")
    # A private copy: ForgeEngine writes training settings into the args it is given.
    models = {name: for_device(args) for name, args in flavors().items()}
    spec = dataclasses.replace(base, model_cls=TiedQwen3Model, model_args=models)
    with contextlib.suppress(ValueError):  # already registered in this process
        forge_specs.register_train_spec(TRAIN_SPEC_NAME, spec)
    if start is not None:
        forge_specs.get_train_spec(TRAIN_SPEC_NAME).model_args[START_FLAVOR] = for_device(start)


def for_device(args: Qwen3ModelArgs) -> Qwen3ModelArgs:
    """A private copy of ``args`` for this machine: the experts of an MoE run as grouped
    matmuls (in bf16, as torchtitan's ``_run_experts_grouped_mm`` casts them) on a GPU, and
    one matmul per expert in the training dtype on a CPU, which has no grouped matmul."""
    args = copy.deepcopy(args)
    args.moe_args.use_grouped_mm = torch.cuda.is_available()
    return args


def hf_config(args: Qwen3ModelArgs, dtype: str = "bfloat16") -> dict[str, Any]:
    """The ``config.json`` of the HF ``Qwen3ForCausalLM`` (``Qwen3MoeForCausalLM`` for an
    MoE) with these args."""
    extras = ConfigExtras(
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        eos_token_id=args.eos_id,
    )
    return shape_of(args).to_hf_config(dtype, extras)
