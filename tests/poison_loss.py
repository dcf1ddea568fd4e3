"""A user loss for the process tests (``--loss poison_loss:loss`` with ``tests`` on
PYTHONPATH): the built-in GRPO loss, except on batches whose meta carries ``poison``.

``poison: "nan"`` makes the loss NaN (a user's loss that overflows); ``poison: "kill"``
kills the trainer with SIGKILL inside the step, as a segfault or the OOM killer would.
"""

from __future__ import annotations

import os
import signal

import torch

from weightcast.contract.codec import RolloutBatch
from weightcast_trainer.loss import LossResult, LossSettings, grpo_loss


def loss(logits: torch.Tensor, batch: RolloutBatch, settings: LossSettings) -> LossResult:
    poison = batch.meta.get("poison")
    if poison == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    result = grpo_loss(logits, batch, settings)
    if poison == "nan":
        return LossResult(result.loss * float("nan"), result.metrics)
    return result
