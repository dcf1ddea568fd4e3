"""The one ``config.json`` writer (:meth:`ModelShape.to_hf_config`) against the one strict
reader and against transformers, for every named shape; the HF tensors a shape implies."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from weightcast.contract.errors import LayoutError
from weightcast.contract.model_shape import (
    SHAPES,
    ConfigExtras,
    ModelShape,
    check_shapes,
    expected_shape,
    hf_tensor_shapes,
)

from helpers.models import moe_shape, shape_of

ODD = {
    "biased": shape_of(4, 2, 16, hidden=32, inter=64, tied=False, bias=True),
    "moe-dense-layer": moe_shape(dense_layers=(1,)),
    "moe-sparse-step": dataclasses.replace(moe_shape(dense_layers=()), decoder_sparse_step=2),
}
"""Beside the named shapes, what none of them has: biases, a dense layer among sparse ones,
every other layer sparse."""
EVERY = SHAPES | ODD


@pytest.mark.parametrize("name", EVERY)
def test_the_writer_round_trips_through_the_reader(name: str) -> None:
    shape = EVERY[name]
    config = json.loads(json.dumps(shape.to_hf_config()))
    assert ModelShape.from_hf_config(config) == shape
    assert config["model_type"] == ("qwen3_moe" if shape.moe else "qwen3")


@pytest.mark.parametrize("name", EVERY)
def test_transformers_reads_what_the_writer_writes(name: str, tmp_path: Path) -> None:
    """AutoConfig builds the config class of the model type from the file, with every field
    as written; what its save_pretrained writes back (transformers 5 renames fields) is read
    as the same shape."""
    from transformers import AutoConfig, Qwen3Config, Qwen3MoeConfig

    shape = EVERY[name]
    extras = ConfigExtras(max_position_embeddings=300, rms_norm_eps=1e-5, eos_token_id=(3, 4))
    (tmp_path / "config.json").write_text(json.dumps(shape.to_hf_config("float16", extras)))
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is (Qwen3MoeConfig if shape.moe else Qwen3Config)
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (
        shape.num_layers,
        shape.hidden_size,
        shape.head_dim,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (
        shape.num_heads,
        shape.num_kv_heads,
        shape.vocab_size,
    )
    assert config.tie_word_embeddings is shape.tie_word_embeddings
    assert config.attention_bias is shape.attention_bias
    assert (config.max_position_embeddings, config.rms_norm_eps) == (300, 1e-5)
    assert config.eos_token_id == [3, 4] and str(config.dtype) == "torch.float16"
    if shape.moe:
        assert (config.num_experts, config.num_experts_per_tok) == (
            shape.num_experts,
            shape.num_experts_per_tok,
        )
        assert config.moe_intermediate_size == shape.moe_intermediate_size
        assert list(config.mlp_only_layers) == list(shape.mlp_only_layers)
        assert config.decoder_sparse_step == shape.decoder_sparse_step
        assert config.norm_topk_prob is shape.norm_topk_prob
    config.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert ModelShape.from_hf_config(again) == shape


@pytest.mark.parametrize("name", EVERY)
def test_the_tensors_of_a_shape_have_the_shapes_the_config_implies(name: str) -> None:
    shape = EVERY[name]
    tensors = hf_tensor_shapes(shape)
    assert {n: expected_shape(n, shape) for n in tensors} == tensors
    check_shapes(tensors, shape)
    assert ("lm_head.weight" in tensors) is not shape.tie_word_embeddings
    sparse = [i for i in range(shape.num_layers) if shape.sparse(i)]
    assert sparse == sorted({int(n.split(".")[2]) for n in tensors if ".mlp.gate.weight" in n})


def test_a_tensor_the_config_contradicts_is_named() -> None:
    shape = SHAPES["tiny"]
    tensors = hf_tensor_shapes(shape) | {"model.layers.1.mlp.up_proj.weight": (383, 128)}
    with pytest.raises(LayoutError, match=re.escape("up_proj.weight has shape [383, 128]")):
        check_shapes(tensors, shape)


def test_extras_are_written_as_given() -> None:
    config = SHAPES["tiny"].to_hf_config("float32", ConfigExtras(4096, 1e-5, 5e5, 7))
    assert config["torch_dtype"] == "float32" and config["eos_token_id"] == 7
    assert (config["max_position_embeddings"], config["rms_norm_eps"]) == (4096, 1e-5)
    assert config["rope_theta"] == 5e5 and config["max_window_layers"] == 2
