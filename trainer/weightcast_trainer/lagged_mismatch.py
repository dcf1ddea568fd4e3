"""The train/inference mismatch of lagged batches, scored against the weights that sampled them.

A batch of policy lag 0 is scored on the logits its training forward computes anyway
(:func:`~weightcast_trainer.train_step.train_step`). A batch sampled from an older step's
version is scored here, before the step: the kept weights of that step
(:class:`~weightcast_trainer.sampling_weights.SamplingWeights`) go into the model, a forward
pass without gradients computes its logits, and the model gets its own weights back.

Under FSDP every rank must hold the same weights and run as many forward passes as the
others, so the ranks agree on each step's weights to put in (the newest any rank needs
first) and on the number of passes; a rank with fewer batches of that step runs passes on
no batch.
"""

from __future__ import annotations

import torch

from weightcast.contract.codec import RolloutBatch
from weightcast_trainer import collectives
from weightcast_trainer.loss import Mismatch, logprob_mismatch
from weightcast_trainer.sampling_weights import SamplingWeights, swapped
from weightcast_trainer.train_step import StepParts, to_device

NONE = -1.0
"""A rank's candidate step when it has nothing (left) to score."""


def scorable(batch: RolloutBatch, sampled: int | None, current: int, kept: SamplingWeights) -> bool:
    """A lagged batch whose sampling step's weights are kept and which carries the engine's
    log-probabilities."""
    return (
        sampled is not None
        and sampled != current
        and sampled in kept
        and batch.old_logprobs is not None
    )


def score_lagged(
    parts: StepParts,
    kept: SamplingWeights,
    batches: list[RolloutBatch],
    sampled: list[int | None],
    current: int,
) -> list[Mismatch | None]:
    """The mismatch of each of this rank's ``batches`` that :func:`scorable` admits, None for
    the others; ``sampled`` is the step whose version sampled each (None: unknown), ``current``
    the step the model holds. Collective: every rank calls it each step."""
    scored: list[Mismatch | None] = [None] * len(batches)
    done: set[int] = set()
    while kept.capacity:  # the same on every rank: nothing kept, nothing to agree on
        wanted = [
            step
            for batch, step in zip(batches, sampled, strict=True)
            if scorable(batch, step, current, kept) and step not in done
        ]
        (chosen,) = collectives.max_over_ranks([float(max(wanted, default=NONE))], parts.device)
        if chosen == NONE:
            return scored
        step = int(chosen)
        done.add(step)
        mine = [
            index
            for index, batch in enumerate(batches)
            if sampled[index] == step and scorable(batch, step, current, kept)
        ]
        (passes,) = collectives.max_over_ranks([float(len(mine))], parts.device)
        parts.before_update()  # a snapshot's copy may still be reading the weights
        with swapped(parts.model, kept.get(step)):
            for index in range(int(passes)):
                if index < len(mine):
                    scored[mine[index]] = _score(parts, batches[mine[index]])
                else:
                    _forward(parts, torch.zeros(1, 2, dtype=torch.long, device=parts.device))
    return scored


def scored_lags(
    batches: list[RolloutBatch],
    sampled: list[int | None],
    current: int,
    scored: list[Mismatch | None],
) -> list[int | None]:
    """Each batch's lag in steps where its mismatch was scored, None where it was not: a
    lagged batch :func:`score_lagged` scored, or a batch of lag 0 with ``old_logprobs``
    (the step scores those on its own logits)."""
    lags: list[int | None] = []
    for batch, step, mismatch in zip(batches, sampled, scored, strict=True):
        on_policy = step == current and batch.old_logprobs is not None
        counted = on_policy or mismatch is not None
        lags.append(current - step if step is not None and counted else None)
    return lags


def _score(parts: StepParts, batch: RolloutBatch) -> Mismatch | None:
    batch = to_device(batch, parts.device)
    return logprob_mismatch(_forward(parts, batch.input_ids), batch)


@torch.no_grad()
def _forward(parts: StepParts, input_ids: torch.Tensor) -> torch.Tensor:
    with parts.forward_context():
        return parts.model(input_ids)
