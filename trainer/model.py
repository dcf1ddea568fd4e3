"""The Qwen3 policy: flavors, the torchtitan train spec, and the model's HF ``config.json``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

from torchtitan.experiments.forge import train_spec as forge_specs
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs

TRAIN_SPEC_NAME = "weightcast_qwen3"
START_FLAVOR = "init-from"
"""The flavor a run started from a checkpoint trains: that checkpoint's own shape."""

TINY = Qwen3ModelArgs(
    vocab_size=1024,
    max_seq_len=1024,
    head_dim=64,
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    qk_norm=True,
    hidden_dim=384,
    rope_theta=1_000_000,
    enable_weight_tying=True,
    eos_id=1,
)
"""Trains on 2 CPU cores in milliseconds a step; GQA (2 kv heads for 4 heads) and a
head_dim (64) that is not hidden/heads (32), like the real 0.6B and 4B."""

SMALL = Qwen3ModelArgs(
    vocab_size=32_000,
    max_seq_len=2048,
    head_dim=64,
    dim=1024,
    n_layers=8,
    n_heads=16,
    n_kv_heads=8,
    qk_norm=True,
    hidden_dim=3072,
    rope_theta=1_000_000,
    enable_weight_tying=True,
    eos_id=1,
)
"""About 133M parameters (a 0.27 GB bf16 snapshot): a mid-size model that a CPU still
trains, for benchmarks and demos without a GPU."""


class TiedQwen3Model(Qwen3Model):
    """torchtitan's Qwen3 with weight tying that survives materialisation.

    torchtitan 0.2.0 ties ``output`` to ``tok_embeddings`` in ``parallelize_qwen3``, but
    without FSDP the later ``to_empty`` gives each its own storage, and the two drift apart.
    Tying again in ``init_weights`` (which runs after ``to_empty`` and before the optimizer
    is built) keeps one parameter in every parallelism.
    """

    def init_weights(self, buffer_device: Any = None) -> None:
        if self.model_args.enable_weight_tying:
            self.output.weight = self.tok_embeddings.weight
        super().init_weights(buffer_device)


def flavors() -> dict[str, Qwen3ModelArgs]:
    """Every dense Qwen3 flavor: ``tiny``, ``small`` and torchtitan's (0.6B ... 32B)."""
    base = forge_specs.get_train_spec("qwen3").model_args
    dense = {name: args for name, args in base.items() if not args.moe_enabled}
    return {"tiny": TINY, "small": SMALL, **dense}


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
    spec = dataclasses.replace(base, model_cls=TiedQwen3Model, model_args=copy.deepcopy(flavors()))
    with contextlib.suppress(ValueError):  # already registered in this process
        forge_specs.register_train_spec(TRAIN_SPEC_NAME, spec)
    if start is not None:
        forge_specs.get_train_spec(TRAIN_SPEC_NAME).model_args[START_FLAVOR] = copy.deepcopy(start)


def hf_config(args: Qwen3ModelArgs, dtype: str = "bfloat16") -> dict[str, Any]:
    """The ``config.json`` of the HF ``Qwen3ForCausalLM`` with these args."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": args.max_seq_len,
        "max_window_layers": args.n_layers,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": args.enable_weight_tying,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "eos_token_id": args.eos_id,
        "torch_dtype": dtype,
    }
