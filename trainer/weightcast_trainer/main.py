"""``weightcast trainer``: pick the device, check the start, build the trainer, run it."""

from __future__ import annotations

from pathlib import Path

import torch

from weightcast.runtime.config import Config
from weightcast.runtime.dirs import check_writable_dir
from weightcast_trainer.device import use_cpu_without_accelerator


def run_trainer(config: Config) -> int:
    """Train. A bad ``--init-from``, a ``--model`` that contradicts it or a refused torchtitan
    setting is a ConfigError before any directory is created or written."""
    use_cpu_without_accelerator()
    from weightcast_trainer.hf_start import check_model_flag, inspect_start  # after the device
    from weightcast_trainer.job import build_job_config
    from weightcast_trainer.model import flavor_args
    from weightcast_trainer.resume import resume_dir
    from weightcast_trainer.worker import Trainer

    cfg = config.trainer
    start = inspect_start(Path(cfg.init_from)) if cfg.init_from else None
    if start is not None and "trainer.model" in config.sources:
        check_model_flag(cfg.model, flavor_args(cfg.model), start)
    job = build_job_config(cfg, resume_dir(config), config.common.redis_retry_seconds)
    check_writable_dir(Path(config.common.checkpoint_dir), "checkpoint_dir")
    check_writable_dir(resume_dir(config), "trainer.resume_dir")
    trainer = Trainer(config, job, start)
    try:
        trainer.run()
    finally:
        trainer.telemetry.close()
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0
