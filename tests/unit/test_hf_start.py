"""``config.json`` -> torchtitan's Qwen3 args (pure), and the torchtitan settings weightcast
refuses because it sets them itself."""

from __future__ import annotations

from typing import Any

import pytest

from weightcast.contract.errors import ConfigError
from weightcast.runtime.config import TrainerConfig
from weightcast.trainer.hf_start import expected_tensors, model_args_from_hf
from weightcast.trainer.job import OWNED_BY_WEIGHTCAST, build_job_config


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


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"architectures": ["Qwen3MoeForCausalLM"]}, "architectures is ['Qwen3MoeForCausalLM']"),
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
    ],
)
def test_a_config_torchtitans_qwen3_cannot_build_is_refused(
    over: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=r"^c\.json: ") as info:
        model_args_from_hf(qwen3_config(**over), "c.json")
    assert message in str(info.value)


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
