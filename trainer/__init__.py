"""The trainer worker: torchtitan 0.2.0 training a Qwen3 policy on rollout batches from Redis.

torchtitan picks its device type when it is first imported and falls back to "cuda" on a
CPU-only torch, so this package makes torch report "cpu" first when no GPU is visible.
Import torchtitan only after this package.
"""

import torch
import torch._utils

if not torch.cuda.is_available() and torch._utils._get_available_device_type() is None:
    torch._utils._get_available_device_type = lambda: "cpu"
