"""torchtitan's job config from weightcast's ``[trainer]`` settings and ``[trainer.*]`` tables."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torchtitan.experiments.forge.job_config import ForgeJobConfig

from weightcast.contract.errors import ConfigError
from weightcast_trainer.model import START_FLAVOR, TRAIN_SPEC_NAME
from weightcast_trainer.settings import TrainerConfig

UNBOUNDED_STEPS = 10**9
"""The LR schedule's horizon when training runs until stopped."""

RESUME_EVERY = 10
"""Default steps between resume checkpoints (torchtitan's ``checkpoint.interval``)."""

COLLECTIVE_MARGIN_S = 120
"""Seconds a collective waits beyond ``redis_retry_seconds``: one rank may be riding out a
Redis outage while the others wait for it in an all-reduce."""

ASYNC_MODES = ("disabled", "async")
"""``[trainer.checkpoint] async_mode`` values: a blocking save, or DCP's async_save in a thread."""

OWNED_BY_WEIGHTCAST = {
    ("model", "name"): "nothing: it is weightcast's own train spec",
    ("model", "flavor"): "trainer.model (--model)",
    ("model", "hf_assets_path"): "trainer.init_from (--init-from)",
    ("checkpoint", "initial_load_path"): "trainer.init_from (--init-from)",
    ("checkpoint", "initial_load_in_hf"): "trainer.init_from (--init-from)",
    ("checkpoint", "initial_load_model_only"): "trainer.init_from (--init-from)",
    ("checkpoint", "load_step"): "nothing: the newest complete resume checkpoint is loaded",
    ("checkpoint", "folder"): "trainer.resume_dir (--resume-dir)",
    ("checkpoint", "enable"): "nothing: resume checkpoints are always on (acks wait for them)",
    ("checkpoint", "last_save_model_only"): "nothing: the last checkpoint is a full one",
    ("checkpoint", "exclude_from_loading"): "nothing: a resume loads every state",
    ("training", "seq_len"): "trainer.seq_len (--seq-len)",
    ("training", "steps"): "trainer.steps (--steps)",
    ("training", "seed"): "trainer.seed",
    ("training", "local_batch_size"): "trainer.micro_batches (a batch is one stream entry)",
    ("training", "dataset"): "nothing: batches come from the Redis stream",
    ("training", "dataset_path"): "nothing: batches come from the Redis stream",
    ("optimizer", "lr"): "trainer.lr (--lr)",
}
"""torchtitan settings weightcast sets itself, with what to use instead: given in a
``[trainer.*]`` table they would be overridden or ignored, so they are refused."""


def build_job_config(
    cfg: TrainerConfig, resume_dir: Path | None = None, redis_retry_seconds: float = 0.0
) -> ForgeJobConfig:
    """torchtitan's job config: weightcast's defaults, then the ``[trainer.*]`` overrides.

    Resume checkpoints use torchtitan's checkpointer (always on, in ``resume_dir``):
    every ``checkpoint.interval`` steps (10) and at exit, the newest ``keep_latest_k`` (2)
    kept, full state (not model-only) also at the last step. Collectives wait at least
    ``redis_retry_seconds`` (plus a margin) for a rank that rides out a Redis outage.
    """
    job = ForgeJobConfig()
    job.model.name = TRAIN_SPEC_NAME
    job.model.flavor = START_FLAVOR if cfg.init_from else cfg.model
    job.model.hf_assets_path = None
    job.training.seq_len = cfg.seq_len
    job.training.steps = cfg.steps or UNBOUNDED_STEPS
    job.training.local_batch_size = 1
    job.training.seed = cfg.seed
    job.optimizer.lr = cfg.lr
    job.training.mixed_precision_param = "bfloat16" if torch.cuda.is_available() else "float32"
    job.lr_scheduler.warmup_steps = 2
    job.lr_scheduler.decay_ratio = 0.0
    job.checkpoint.interval = RESUME_EVERY
    job.checkpoint.keep_latest_k = 2
    job.comm.trace_buf_size = 0
    job.comm.init_timeout_seconds = max(
        job.comm.init_timeout_seconds, int(redis_retry_seconds) + COLLECTIVE_MARGIN_S
    )
    for section_name, values in cfg.titan.items():
        section = getattr(job, section_name, None)
        if not dataclasses.is_dataclass(section):
            known = ", ".join(f.name for f in dataclasses.fields(job))
            raise ConfigError(
                f"unknown torchtitan section [trainer.{section_name}]; known: {known}"
            )
        names = {f.name for f in dataclasses.fields(section)}
        for key, value in values.items():
            if key not in names:
                raise ConfigError(
                    f"[trainer.{section_name}] has no setting {key!r}; "
                    f"known: {', '.join(sorted(names))}"
                )
            instead = OWNED_BY_WEIGHTCAST.get((section_name, key))
            if instead is not None:
                raise ConfigError(
                    f"[trainer.{section_name}] {key} is set by weightcast; use {instead}"
                )
            setattr(section, key, value)
    if job.training.debug_moe_force_load_balance:
        raise ConfigError(
            "[trainer.training] debug_moe_force_load_balance routes tokens round-robin in "
            "training, not as the published model routes them; leave it false"
        )
    job.checkpoint.enable = True
    job.checkpoint.folder = str(resume_dir or Path(job.checkpoint.folder).absolute())
    job.checkpoint.last_save_model_only = False
    job.checkpoint.async_mode = job.checkpoint.async_mode.lower()
    if job.checkpoint.async_mode not in ASYNC_MODES:
        raise ConfigError(
            f"[trainer.checkpoint] async_mode {job.checkpoint.async_mode!r} is not supported; "
            f"choose one of {', '.join(ASYNC_MODES)} ('async_with_pinned_mem' needs "
            "torchtitan's GPU staging path, which weightcast does not drive)"
        )
    if job.checkpoint.interval < 1:
        raise ConfigError("[trainer.checkpoint] interval must be >= 1")
    if job.checkpoint.keep_latest_k == 1:
        raise ConfigError(
            "[trainer.checkpoint] keep_latest_k must be 0 (keep all) or >= 2: the newest "
            "checkpoint may be unfinished when the trainer dies, and the one before it is "
            "what it resumes from"
        )
    return job
