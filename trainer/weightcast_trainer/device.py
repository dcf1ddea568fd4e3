"""The device type torchtitan trains on, chosen before torchtitan is imported."""

from __future__ import annotations

import torch
import torch._utils


def use_cpu_without_accelerator() -> None:
    """Make torch report ``"cpu"`` as the available device type when no GPU is visible.

    torchtitan reads the device type once, when it is first imported, and falls back to
    ``"cuda"`` on a CPU-only torch, which then fails to build the model. Call this before the
    first torchtitan import; with a GPU (or another accelerator) it changes nothing.
    """
    if not torch.cuda.is_available() and torch._utils._get_available_device_type() is None:
        torch._utils._get_available_device_type = lambda: "cpu"
