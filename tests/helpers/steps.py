"""A tiny language model and the parts of a train step around it, in a world of one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer

from weightcast.contract.codec import RolloutBatch
from weightcast_trainer.loss import LossFn, LossSettings, grpo_loss
from weightcast_trainer.train_step import StepParts

VOCAB = 11


@contextlib.contextmanager
def process_group_of_one() -> Iterator[None]:
    """The step's sums go through the collectives, which need a process group."""
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def make_parts(model: torch.nn.Module, loss: LossFn = grpo_loss) -> StepParts:
    """Plain SGD at rate 1 and no clipping: an applied update is minus the gradient."""
    optimizers = OptimizersContainer([model], torch.optim.SGD, {"lr": 1.0})
    return StepParts(
        model=model,
        optimizers=optimizers,
        lr_schedulers=LRSchedulersContainer(optimizers, lambda _step: 1.0),
        loss=loss,
        loss_settings=LossSettings(),
        max_norm=1e9,
        device=torch.device("cpu"),
        dp_degree=1,
        forward_context=contextlib.nullcontext,
        before_update=lambda: None,
    )


def make_batch(mask: list[list[int]], seed: int, **meta: object) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    loss_mask = torch.tensor(mask, dtype=torch.float32)
    return RolloutBatch(
        input_ids=torch.randint(0, VOCAB, loss_mask.shape, generator=gen),
        loss_mask=loss_mask,
        advantages=torch.randn(loss_mask.shape[0], 1, generator=gen)
        .expand_as(loss_mask)
        .contiguous(),
        old_logprobs=-loss_mask,  # log-probability e^-1 on trained tokens, 0 elsewhere
        meta={"policy_version": 0, **meta},
    )
