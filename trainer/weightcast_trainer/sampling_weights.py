"""The bf16 weights of the steps the trainer published last, kept to score lagged batches.

A batch sampled from the version of step ``S`` carries the engine's log-probabilities under
``S``'s weights; by the time it trains, the trainer holds later ones. The trainer wrote that
snapshot itself, so it keeps a host copy of each published step's parameters (this rank's
shards, in bf16 as the snapshot has them) for the newest :attr:`SamplingWeights.capacity`
steps, and :func:`swapped` puts one of them into the live model for a forward pass: the
train/inference mismatch of a batch of any lag is then scored against the weights that
sampled it. Memory is bounded by the capacity, set from a byte budget per rank.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

KEPT_DTYPE = torch.bfloat16
"""The snapshot's dtype: what the publisher turns into the version the engine serves."""


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local tensor, shared storage), or itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def version_bytes(model: nn.Module) -> int:
    """Bytes of one kept copy of this rank's parameters."""
    itemsize = torch.empty((), dtype=KEPT_DTYPE).element_size()
    return sum(local_shard(p).numel() * itemsize for p in model.parameters())


def capacity_for(budget_bytes: int, one_version: int, max_policy_lag: int = -1) -> int:
    """How many versions of ``one_version`` bytes fit in ``budget_bytes``, and no more than
    ``max_policy_lag + 1`` (batches of older versions are dropped as stale, never scored;
    a negative lag keeps every batch, so only the budget bounds them)."""
    fit = budget_bytes // one_version if one_version > 0 else 0
    return min(fit, max_policy_lag + 1) if max_policy_lag >= 0 else fit


class SamplingWeights:
    """The newest ``capacity`` published steps' parameters, by step, on the host in bf16.

    Every rank keeps the same steps (snapshots are taken at the same steps everywhere, and
    the capacity is agreed), so a step one rank holds, all do.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()

    @property
    def steps(self) -> list[int]:
        """The steps kept, oldest first."""
        return list(self._kept)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self._kept.values() for t in w.values())

    def __contains__(self, step: object) -> bool:
        return step in self._kept

    def get(self, step: int) -> dict[str, torch.Tensor]:
        return self._kept[step]

    @torch.no_grad()
    def keep(self, step: int, model: nn.Module) -> None:
        """Copy ``model``'s parameters as they are now, the weights of ``step``; drop the
        oldest step beyond the capacity (before copying: never one version too many)."""
        if self.capacity <= 0:
            return
        self._kept.pop(step, None)  # a step published again (after a restart) is replaced
        while len(self._kept) >= self.capacity:
            self._kept.popitem(last=False)
        self._kept[step] = {
            name: local_shard(p).detach().to("cpu", KEPT_DTYPE, copy=True)
            for name, p in model.named_parameters()
        }


@contextlib.contextmanager
def swapped(model: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """``model`` holds ``weights`` (cast to its own dtype) inside the block; outside it, its
    own weights again, bitwise, whatever the block raised.

    The parameters are overwritten in place (their local shards), so FSDP's all-gathers, the
    optimizer's references and its state see the same tensors throughout; a copy of this
    rank's shards, in their own dtype, on their own device, is the price. FSDP modules that
    kept their gathered parameters after a forward (the root does, until a backward that
    never comes under ``no_grad``) are resharded on the way in and out, so no gathered copy
    of either weights outlives the swap.
    """
    params = dict(model.named_parameters())
    saved = {name: local_shard(p).detach().clone() for name, p in params.items()}
    _reshard(model)
    try:
        with torch.no_grad():
            for name, p in params.items():
                local_shard(p).copy_(weights[name])
        yield
    finally:
        _reshard(model)
        with torch.no_grad():
            for name, p in params.items():
                local_shard(p).copy_(saved[name])


def _reshard(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
