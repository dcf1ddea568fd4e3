"""The trainer's torchtitan job config: weightcast's defaults and the [trainer.*] overrides."""

from __future__ import annotations

import pytest

from weightcast.contract.errors import ConfigError
from weightcast.contract.model_shape import SHAPES, ModelShape
from weightcast_trainer.job import UNBOUNDED_STEPS, build_job_config
from weightcast_trainer.model import TRAIN_SPEC_NAME, flavors, hf_config, qwen3_args, shape_of
from weightcast_trainer.settings import MODELS, MOE_MODELS, TrainerConfig


def test_weightcast_settings_and_overrides_reach_torchtitan() -> None:
    cfg = TrainerConfig(
        model="0.6B",
        steps=0,
        seq_len=512,
        lr=1e-6,
        titan={"optimizer": {"eps": 1e-9}, "lr_scheduler": {"warmup_steps": 7}},
    )
    job = build_job_config(cfg)
    assert (job.model.name, job.model.flavor) == (TRAIN_SPEC_NAME, "0.6B")
    assert job.training.seq_len == 512 and job.training.steps == UNBOUNDED_STEPS
    assert job.optimizer.lr == 1e-6 and job.optimizer.eps == 1e-9
    assert job.lr_scheduler.warmup_steps == 7


@pytest.mark.parametrize(
    ("titan", "message"),
    [
        ({"optimiser": {"lr": 1.0}}, "unknown torchtitan section [trainer.optimiser]"),
        (
            {"optimizer": {"learning_rate": 1.0}},
            "[trainer.optimizer] has no setting 'learning_rate'",
        ),
    ],
)
def test_unknown_torchtitan_settings_are_refused(titan: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        build_job_config(TrainerConfig(titan=titan))
    assert message in str(error.value)


def test_flavors_and_their_hf_config() -> None:
    available = flavors()
    assert {"tiny", "0.6B", "1.7B", "4B", "8B"} <= set(available)
    tiny = available["tiny"]
    assert tiny.n_kv_heads < tiny.n_heads and tiny.head_dim * tiny.n_heads != tiny.dim
    config = hf_config(available["0.6B"])
    shape = (config["hidden_size"], config["head_dim"], config["num_key_value_heads"])
    assert shape == (1024, 128, 8)
    assert config["tie_word_embeddings"] is True and config["model_type"] == "qwen3"
    assert hf_config(available["8B"])["tie_word_embeddings"] is False


@pytest.mark.parametrize("name", ["tiny", "small", "tiny-moe"])
def test_weightcasts_own_flavors_are_the_named_shapes(name: str) -> None:
    args = flavors()[name]
    assert shape_of(args) == SHAPES[name]
    assert ModelShape.from_hf_config(hf_config(args)) == SHAPES[name]


def test_every_flavor_survives_its_config_json() -> None:
    """shape_of inverts qwen3_args: a flavor's config.json gives the flavor back (an MoE's
    dense layers included)."""
    for name, args in flavors().items():
        shape = ModelShape.from_hf_config(hf_config(args))
        again = qwen3_args(shape, args.max_seq_len, args.rope_theta, args.norm_eps, args.eos_id)
        assert shape_of(again) == shape, name
        assert again.moe_enabled == args.moe_enabled


def test_async_resume_checkpoints_are_accepted() -> None:
    job = build_job_config(TrainerConfig(titan={"checkpoint": {"async_mode": "Async"}}))
    assert job.checkpoint.async_mode == "async"


@pytest.mark.parametrize(
    ("checkpoint", "message"),
    [
        ({"async_mode": "async_with_pinned_mem"}, "async_mode 'async_with_pinned_mem' is not"),
        ({"async_mode": "later"}, "choose one of disabled, async"),
        ({"keep_latest_k": 1}, "keep_latest_k must be 0 (keep all) or >= 2"),
        ({"async_mode": "async", "keep_latest_k": 1}, "keep_latest_k must be 0"),
    ],
)
def test_resume_checkpoint_settings_that_could_lose_batches_are_refused(
    checkpoint: dict, message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        build_job_config(TrainerConfig(titan={"checkpoint": checkpoint}))
    assert message in str(error.value)


def test_the_model_setting_lists_exactly_the_flavors_the_trainer_builds() -> None:
    assert set(MODELS) == {name for name, args in flavors().items() if not args.moe_enabled}
    assert set(MOE_MODELS) == {name for name, args in flavors().items() if args.moe_enabled}
