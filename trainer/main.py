"""``weightcast trainer``: pick the device, build the trainer, run it, tear it down."""

from __future__ import annotations

import torch

from weightcast.runtime.config import Config
from weightcast.trainer.device import use_cpu_without_accelerator


def run_trainer(config: Config) -> int:
    use_cpu_without_accelerator()
    from weightcast.trainer.worker import Trainer  # imports torchtitan: after the device

    trainer = Trainer(config)
    try:
        trainer.run()
    finally:
        trainer.telemetry.close()
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0
