"""What a rollout node samples from, in its own module so that the engines that provide one
(transformers in :mod:`~weightcast.local.rollout`, vLLM in
:mod:`~weightcast.local.vllm_rollout`) need not import each other."""

from __future__ import annotations

from typing import Protocol

import torch


class Policy(Protocol):
    """Something to sample completions from; ``version`` tags the batches it produces."""

    version: int
    vocab_size: int

    def sample(
        self, prompts: torch.Tensor, length: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, length]`` sampled token ids and the log-probability each was sampled with."""
