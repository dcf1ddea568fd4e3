"""``config.json`` -> torchtitan's Qwen3 args (pure), and the torchtitan settings weightcast
refuses because it sets them itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from weightcast.contract.errors import ConfigError
from weightcast_trainer.hf_start import expected_tensors, model_args_from_hf
from weightcast_trainer.job import OWNED_BY_WEIGHTCAST, build_job_config
from weightcast_trainer.settings import TrainerConfig


def qwen3_config(**over: Any) -> dict[str, Any]:
    """A ``config.json`` as transformers 5 writes it (``rope_parameters``, ``dtype``)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 12345.0, "rope_type": "default"},
        "max_position_embeddings": 300,
        "tie_word_embeddings": True,
        "eos_token_id": 7,
        "attention_bias": False,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "dtype": "bfloat16",
        **over,
    }


def test_every_field_of_the_shape_comes_from_config_json() -> None:
    args = model_args_from_hf(qwen3_config(), "c.json")
    assert (args.vocab_size, args.dim, args.hidden_dim, args.n_layers) == (1000, 64, 96, 2)
    assert (args.n_heads, args.n_kv_heads, args.head_dim) == (4, 2, 24)
    assert (args.norm_eps, args.rope_theta, args.max_seq_len) == (1e-5, 12345.0, 300)
    assert args.enable_weight_tying and args.eos_id == 7 and args.qk_norm


def test_transformers_4_fields_and_defaults() -> None:
    config = qwen3_config(rope_theta=5e5, eos_token_id=[3, 4], tie_word_embeddings=False)
    for name in ("rope_parameters", "head_dim", "num_key_value_heads", "rms_norm_eps"):
        del config[name]
    args = model_args_from_hf(config, "c.json")
    assert args.rope_theta == 5e5 and args.eos_id == 3 and not args.enable_weight_tying
    assert args.head_dim == 16 and args.n_kv_heads == 4 and args.norm_eps == 1e-6


DENSE_REFUSALS: list[tuple[dict[str, Any], str]] = [
    (
        {"architectures": ["Qwen3ForCausalLM", "X"]},
        "architectures is ['Qwen3ForCausalLM', 'X']",
    ),
    ({"architectures": ["LlamaForCausalLM"]}, "architectures is ['LlamaForCausalLM']"),
    ({"architectures": []}, "architectures is []"),
    ({"model_type": "qwen3_moe"}, "model_type is 'qwen3_moe', not 'qwen3'"),
    ({"architectures": None}, "architectures is None"),
    ({"model_type": "llama"}, "model_type is 'llama'"),
    ({"attention_bias": True}, "attention_bias is True"),
    ({"use_sliding_window": True}, "use_sliding_window is True"),
    ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type 'default'"),
    ({"hidden_size": 64.0}, "hidden_size is 64.0, not a positive integer"),
    ({"vocab_size": True}, "vocab_size is True, not a positive integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0, not a positive integer"),
    (
        {"num_key_value_heads": 3},
        "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive number, got -1.0"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings is 'yes', not true or false"),
    ({"eos_token_id": "end"}, "eos_token_id must be a token id, got 'end'"),
]


def test_the_expected_tensors_are_the_hf_names_torchtitan_builds() -> None:
    tied = expected_tensors(model_args_from_hf(qwen3_config(), "c.json"))
    untied = expected_tensors(model_args_from_hf(qwen3_config(tie_word_embeddings=False), "c"))
    assert set(untied) - set(tied) == {"lm_head.weight"}
    assert tied["model.layers.1.self_attn.q_proj.weight"] == (4 * 24, 64)
    assert tied["model.layers.0.self_attn.k_proj.weight"] == (2 * 24, 64)
    assert tied["model.embed_tokens.weight"] == (1000, 64)
    assert len(tied) == 1 + 1 + 2 * 11


@pytest.mark.parametrize(("section", "key"), sorted(OWNED_BY_WEIGHTCAST))
def test_torchtitan_settings_weightcast_sets_are_refused_naming_what_to_use(
    section: str, key: str
) -> None:
    cfg = TrainerConfig(titan={section: {key: "x"}})
    with pytest.raises(ConfigError) as info:
        build_job_config(cfg)
    assert str(info.value) == (
        f"[trainer.{section}] {key} is set by weightcast; use {OWNED_BY_WEIGHTCAST[section, key]}"
    )


def test_the_silently_ignored_initial_load_names_init_from() -> None:
    titan = {"checkpoint": {"initial_load_path": "/hf", "initial_load_in_hf": True}}
    with pytest.raises(ConfigError, match=r"use trainer.init_from \(--init-from\)"):
        build_job_config(TrainerConfig(titan=titan))


def test_torchtitans_warnings_reach_weightcasts_log(capsys: pytest.CaptureFixture[str]) -> None:
    """torchtitan logs through the root logger, which nothing configured: its warnings
    printed bare or vanished. They now come out in weightcast's format, named."""
    import logging
    import warnings

    from torchtitan.config import JobConfig

    from weightcast.runtime.logs import configure_logging

    logging.captureWarnings(False)  # an in-process CLI test before may have left it on
    configure_logging("text", "INFO")
    try:
        job = JobConfig()
        job.training.seq_len = 10**6
        model_args_from_hf(qwen3_config(), "c.json").update_from_config(job)
        warnings.warn("a library's warning", UserWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
        logging.getLogger().handlers.clear()
    err = capsys.readouterr().err
    assert "WARNING torchtitan: Sequence length 1000000 exceeds original maximum 300" in err
    assert "WARNING py.warnings: " in err and "a library's warning" in err


def qwen3_moe_config(**over: Any) -> dict[str, Any]:
    """A Qwen3-MoE ``config.json`` as transformers 5 writes it (``num_local_experts``)."""
    moe = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_local_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 40,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }
    return qwen3_config(**(moe | over))


def test_the_experts_and_router_come_from_config_json() -> None:
    args = model_args_from_hf(qwen3_moe_config(), "c.json")
    moe = args.moe_args
    assert args.moe_enabled and args.moe_inter_dim == 40 and args.hidden_dim == 96
    assert (moe.num_experts, moe.top_k, moe.route_norm) == (6, 2, True)
    assert (moe.score_func, moe.route_scale, moe.score_before_experts) == ("softmax", 1.0, False)
    assert moe.num_shared_experts == 0 and moe.load_balance_coeff is None
    plain = model_args_from_hf(qwen3_moe_config(norm_topk_prob=False), "c.json")
    assert not plain.moe_args.route_norm


def test_num_experts_as_qwen_writes_it_and_transformers_defaults() -> None:
    """Qwen's own checkpoints name ``num_experts``; fields left out take Qwen3MoeConfig's."""
    config = qwen3_moe_config(num_experts=6)
    for name in ("num_local_experts", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        del config[name]
    moe = model_args_from_hf(config, "c.json").moe_args
    assert moe.num_experts == 6 and not moe.route_norm
    del config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]
    args = model_args_from_hf(config, "c.json")
    assert (args.moe_args.num_experts, args.moe_args.top_k, args.moe_inter_dim) == (128, 8, 768)


MOE_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"model_type": "qwen3"}, "model_type is 'qwen3', not 'qwen3_moe'"),
    ({"num_local_experts": 0}, "num_experts is 0, not a positive integer"),
    ({"num_experts_per_tok": 2.0}, "num_experts_per_tok is 2.0, not a positive integer"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size is None, not a positive"),
    ({"num_experts_per_tok": 7}, "num_experts_per_tok 7 is more than num_experts 6"),
    ({"num_experts": 8}, "num_local_experts 6 and num_experts 8 differ"),
    ({"norm_topk_prob": 1}, "norm_topk_prob is 1, not true or false"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step is 0, not a positive integer"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers is '0', not a list of layer indices"),
    ({"mlp_only_layers": [2]}, "mlp_only_layers names layer 2; the model's layers are 0 to 1"),
    ({"mlp_only_layers": [-1]}, "mlp_only_layers names layer -1"),
    ({"output_router_logits": True}, "output_router_logits is true: torchtitan 0.2.0's"),
    ({"attention_bias": True}, "attention_bias is True"),
]


@pytest.mark.parametrize(
    ("config", "message"),
    [(qwen3_config(**over), message) for over, message in DENSE_REFUSALS]
    + [(qwen3_moe_config(**over), message) for over, message in MOE_REFUSALS],
)
def test_a_config_torchtitans_qwen3_cannot_build_is_refused(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=r"^c\.json: ") as info:
        model_args_from_hf(config, "c.json")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("over", "dense"),
    [
        ({}, ()),
        ({"mlp_only_layers": [0]}, (0,)),
        ({"decoder_sparse_step": 2}, (0,)),  # transformers: sparse where (layer + 1) % step == 0
        ({"decoder_sparse_step": 3, "mlp_only_layers": [1]}, (0, 1)),
        ({"decoder_sparse_step": 3}, (0, 1)),
    ],
)
def test_dense_layers_among_moe_ones_are_the_ones_transformers_makes_dense(
    over: dict[str, Any], dense: tuple[int, ...]
) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = qwen3_moe_config(**over)
    assert model_args_from_hf(config, "c.json").dense_layers == dense
    with torch.device("meta"):
        reference = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config))
    hf_dense = tuple(
        i for i, layer in enumerate(reference.model.layers) if hasattr(layer.mlp, "up_proj")
    )
    assert hf_dense == dense


def test_the_expected_tensors_of_a_dense_layer_among_moe_ones_are_hfs_mlp() -> None:
    expected = expected_tensors(model_args_from_hf(qwen3_moe_config(mlp_only_layers=[1]), "c"))
    assert expected["model.layers.1.mlp.gate_proj.weight"] == (96, 64)  # intermediate_size
    assert expected["model.layers.1.mlp.down_proj.weight"] == (64, 96)
    assert not any(name.startswith("model.layers.1.mlp.experts") for name in expected)
    assert expected["model.layers.0.mlp.experts.5.up_proj.weight"] == (40, 64)


def test_the_expected_tensors_of_an_moe_are_hfs_per_expert_names() -> None:
    expected = expected_tensors(model_args_from_hf(qwen3_moe_config(), "c.json"))
    for layer in range(2):
        assert expected[f"model.layers.{layer}.mlp.gate.weight"] == (6, 64)
        for e in range(6):
            experts = f"model.layers.{layer}.mlp.experts.{e}"
            assert expected[f"{experts}.gate_proj.weight"] == (40, 64)
            assert expected[f"{experts}.up_proj.weight"] == (40, 64)
            assert expected[f"{experts}.down_proj.weight"] == (64, 40)
    assert not any("mlp.gate_proj" in name or "expert_bias" in name for name in expected)
    assert len(expected) == 1 + 1 + 2 * (8 + 1 + 6 * 3)


def test_the_moe_flavors_config_json_reads_back_as_the_same_model() -> None:
    """``hf_config`` of each MoE flavor (what snapshots carry) is a Qwen3-MoE config that
    ``--init-from`` maps back to that flavor's shape and router."""
    from weightcast_trainer.hf_start import _shape_fields
    from weightcast_trainer.model import flavors, hf_config

    moe = {name: args for name, args in flavors().items() if args.moe_enabled}
    assert {"tiny-moe", "30B-A3B"} <= set(moe)
    for name, args in moe.items():
        config = hf_config(args)
        assert config["architectures"] == ["Qwen3MoeForCausalLM"], name
        back = model_args_from_hf(config, name)
        assert _shape_fields(back) == _shape_fields(args), name
        assert back.moe_args == args.moe_args, name


def test_the_debug_round_robin_routing_is_refused() -> None:
    titan = {"training": {"debug_moe_force_load_balance": True}}
    with pytest.raises(ConfigError, match="debug_moe_force_load_balance routes tokens"):
        build_job_config(TrainerConfig(titan=titan))
