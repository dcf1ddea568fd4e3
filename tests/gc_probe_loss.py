"""A user loss for the process tests (``--loss gc_probe_loss:loss`` with ``tests`` on
PYTHONPATH): the built-in GRPO loss, and a record of the trainer's garbage collections.

Each explicit collection (Python's automatic one is off under torchtitan) and each loss call
appends a line to the file ``WEIGHTCAST_TEST_GC_LOG`` names, in order: ``gc <generation>``
or ``loss``. A test reads which steps collected.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from weightcast.contract.codec import RolloutBatch
from weightcast_trainer.loss import LossResult, LossSettings, grpo_loss


def _record(line: str) -> None:
    with open(os.environ["WEIGHTCAST_TEST_GC_LOG"], "a") as out:
        out.write(line + "\n")


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _record(f"gc {info['generation']}")


gc.callbacks.append(_on_gc)


def loss(logits: torch.Tensor, batch: RolloutBatch, settings: LossSettings) -> LossResult:
    _record("loss")
    return grpo_loss(logits, batch, settings)
