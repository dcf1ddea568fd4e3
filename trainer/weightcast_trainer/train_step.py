"""What one optimizer step computes: the forward-backward of each micro-batch, then the step.

As in torchtitan's ``Trainer``, :func:`forward_backward` handles one micro-batch and
:func:`train_step` the step around them: the loss scaling that makes micro-batches on every
rank add up to one big batch, the gradient clipping, the step's one device-to-host read,
and the optimizer and LR schedule step, skipped when a loss or the gradient norm is not
finite. Which batches a step trains is :mod:`weightcast_trainer.step_plan`'s; what happens
to them afterwards (acknowledging, dead-lettering) is the loop's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as dist_utils

from weightcast.contract.codec import RolloutBatch
from weightcast_trainer import collectives
from weightcast_trainer.loss import (
    LossFn,
    LossSettings,
    Mismatch,
    logprob_mismatch,
    policy_entropy,
    trained_tokens,
)

STEP_METRICS = ("loss", "kl", "entropy", "clip_fraction")
"""Per-step figures averaged over the trained tokens of all micro-batches and ranks."""

Figures = dict[str, float | torch.Tensor]
"""One micro-batch's named figures, floats or 0-dim tensors not read yet."""


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a step works on: the model, its optimizer and LR schedule, the loss."""

    model: torch.nn.Module
    """The one model part (pipeline parallelism is refused)."""
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    loss: LossFn
    loss_settings: LossSettings
    max_norm: float
    """The gradient norm is clipped to this."""
    device: torch.device
    dp_degree: int
    """Data-parallel ranks: FSDP averages gradients over them, the loss scale undoes it."""
    forward_context: Callable[[], AbstractContextManager[object]]
    """Entered around each forward pass (torchtitan's train context and autocast)."""
    before_update: Callable[[], None]
    """Called just before the optimizer changes the weights (a snapshot's copy may still be
    reading them)."""


@dataclasses.dataclass
class StepTotals:
    """What one step adds up over its micro-batches, then over the ranks.

    Each metric of :data:`STEP_METRICS` is a token-weighted sum and the tokens that weigh it
    (a micro-batch whose loss was not finite adds none), so its mean is the one over every
    trained token of the step.
    """

    weighted: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(STEP_METRICS, 0.0)
    )
    weights: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(STEP_METRICS, 0.0)
    )
    input_tokens: float = 0.0
    failed_losses: float = 0.0
    """Micro-batches whose loss was not finite."""
    mismatch_kl: float = 0.0
    """Summed k3 KL(engine || trainer) of the trained tokens of the batches scored."""
    mismatch_tokens: float = 0.0
    mismatch_max: float = -1.0
    """Largest log-probability difference of those tokens; -1 when there were none."""

    def add_mismatch(self, kl: float, tokens: float, max_abs: float) -> None:
        """One scored micro-batch's :class:`~weightcast_trainer.loss.Mismatch`, read."""
        self.mismatch_kl += kl
        self.mismatch_tokens += tokens
        self.mismatch_max = max(self.mismatch_max, max_abs)

    def add(self, values: dict[str, float], trained: float, inputs: int, finite: bool) -> None:
        self.input_tokens += inputs
        if not finite:
            self.failed_losses += 1
            return
        for name in STEP_METRICS:
            if name in values:
                self.weighted[name] += values[name] * trained
                self.weights[name] += trained

    def over_ranks(self, device: torch.device) -> StepTotals:
        """The sums of every rank, in one all-reduce."""
        named = {f"weighted.{k}": v for k, v in self.weighted.items()}
        named |= {f"weights.{k}": v for k, v in self.weights.items()}
        named |= {"input_tokens": self.input_tokens, "failed_losses": self.failed_losses}
        named |= {"mismatch_kl": self.mismatch_kl, "mismatch_tokens": self.mismatch_tokens}
        summed = collectives.sum_over_ranks(named, device)
        (largest,) = collectives.max_over_ranks([self.mismatch_max], device)
        return StepTotals(
            {k: summed[f"weighted.{k}"] for k in STEP_METRICS},
            {k: summed[f"weights.{k}"] for k in STEP_METRICS},
            summed["input_tokens"],
            summed["failed_losses"],
            summed["mismatch_kl"],
            summed["mismatch_tokens"],
            largest,
        )

    def means(self) -> dict[str, float]:
        """Each metric's mean over the trained tokens that reported it, and the mismatch
        (``mismatch_kl``: mean KL per token, ``mismatch_max``) when a batch was scored."""
        means = {k: self.weighted[k] / self.weights[k] for k in STEP_METRICS if self.weights[k]}
        if self.mismatch_tokens:
            means["mismatch_kl"] = self.mismatch_kl / self.mismatch_tokens
            means["mismatch_max"] = self.mismatch_max
        return means


@dataclasses.dataclass
class StepOutcome:
    """What one optimizer step computed, and whether its update was applied."""

    metrics: dict[str, float]
    applied: bool
    finite: list[bool]
    """Per micro-batch of this rank: was its loss finite."""
    loss_failed_somewhere: bool
    """Some micro-batch on some rank had a non-finite loss."""


def train_step(
    parts: StepParts,
    batches: list[RolloutBatch],
    passes: int,
    on_policy: list[bool],
    scored: list[Mismatch | None] | None = None,
) -> StepOutcome:
    """One optimizer step over this rank's micro-batches, in ``passes`` forward/backward
    passes (the ones beyond ``batches`` on no batch, with zero weight). For the batches
    ``on_policy`` marks, it also measures the train/inference mismatch
    (:func:`~weightcast_trainer.loss.logprob_mismatch`) on the logits it computes anyway;
    ``scored`` holds the mismatch of lagged batches, measured already against the weights
    that sampled them (:mod:`weightcast_trainer.lagged_mismatch`), read and summed with it.

    Each micro-batch's loss (a mean over its trained tokens) is weighted by its share of
    the trained tokens of the whole step on all ranks, so the update is the one a single
    batch holding every sequence would give. The update is applied only when every loss
    on every rank and the gradient norm are finite; otherwise the gradients are dropped
    and the weights, optimizer state and LR schedule stay as they were.
    """
    parts.optimizers.zero_grad()
    tokens = [trained_tokens(b) for b in batches]
    total = collectives.sum_over_ranks({"tokens": float(sum(tokens))}, parts.device)["tokens"]
    figures: list[Figures] = []
    for index in range(passes):
        if index >= len(batches):
            idle_pass(parts)
            continue
        scale = tokens[index] * parts.dp_degree / total
        figures.append(forward_backward(parts, batches[index], scale, on_policy[index]))
        if scored is not None:
            figures[-1].update(_mismatch_figures(scored[index]))
    grad_norm = dist_utils.clip_grad_norm_(
        list(parts.model.parameters()), parts.max_norm, foreach=True
    )
    # The step's one sync: every figure of every micro-batch and the norm, read at once.
    *read, last = read_figures([*figures, {"grad_norm": grad_norm}], parts.device)
    grad_norm = last["grad_norm"]
    totals = StepTotals()
    finite = []
    for index, values in enumerate(read):
        finite.append(math.isfinite(values["loss"]))
        totals.add(values, tokens[index], batches[index].num_tokens, finite[-1])
        if "mismatch_kl" in values:
            totals.add_mismatch(
                values["mismatch_kl"], values["mismatch_tokens"], values["mismatch_max"]
            )
    totals = totals.over_ranks(parts.device)
    loss_failed = totals.failed_losses > 0
    metrics = totals.means() | {"grad_norm": grad_norm, "tokens": totals.input_tokens}
    if loss_failed or not math.isfinite(grad_norm):
        parts.optimizers.zero_grad()
        return StepOutcome(metrics, False, finite, loss_failed)
    metrics["lr"] = parts.lr_schedulers.schedulers[0].get_last_lr()[0]  # this step's rate
    parts.before_update()
    parts.optimizers.step()
    parts.lr_schedulers.step()
    return StepOutcome(metrics, True, finite, loss_failed)


def forward_backward(
    parts: StepParts, batch: RolloutBatch, scale: float, measure_mismatch: bool
) -> Figures:
    """One micro-batch's forward pass, loss and backward pass of the loss times ``scale``;
    its figures (the loss's metrics, ``loss``, ``entropy``, and with ``measure_mismatch``
    the mismatch), not read yet: reading them is the step's one sync."""
    batch = to_device(batch, parts.device)
    with parts.forward_context():
        logits = parts.model(batch.input_ids)
        result = parts.loss(logits, batch, parts.loss_settings)
    figures: Figures = {
        **result.metrics,
        "loss": result.loss.detach(),
        "entropy": policy_entropy(logits, batch),
    }
    if measure_mismatch:
        figures.update(_mismatch_figures(logprob_mismatch(logits, batch)))
    del logits
    (result.loss * scale).backward()
    return figures


def idle_pass(parts: StepParts) -> None:
    """A forward and backward pass that adds nothing to the gradients: FSDP's collectives
    need every rank to run as many passes as the busiest one."""
    tokens = torch.zeros(1, 2, dtype=torch.long, device=parts.device)
    with parts.forward_context():
        logits = parts.model(tokens)
    (logits.float().sum() * 0.0).backward()


def read_figures(rows: list[Figures], device: torch.device) -> list[dict[str, float]]:
    """``rows`` with every 0-dim tensor read as a float, all in one device-to-host copy:
    each ``.item()`` would wait for the device on its own. A tensor of more than one value
    (a user's loss metric) is a :class:`ValueError` naming it."""
    tensors = []
    for row in rows:
        for name, value in row.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"loss metric {name!r} is a tensor of {value.numel()} values; "
                        "return a float or a tensor of one value"
                    )
                tensors.append(value)
    host = iter(
        torch.stack([t.detach().reshape(()).to(device, torch.float64) for t in tensors]).tolist()
        if tensors
        else []
    )
    return [
        {k: next(host) if isinstance(v, torch.Tensor) else float(v) for k, v in row.items()}
        for row in rows
    ]


def _mismatch_figures(mismatch: Mismatch | None) -> dict[str, torch.Tensor]:
    if mismatch is None:
        return {}
    return {
        "mismatch_kl": mismatch.kl,
        "mismatch_tokens": mismatch.tokens,
        "mismatch_max": mismatch.max_abs,
    }


def to_device(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    """``batch`` with every tensor on ``device``."""
    return dataclasses.replace(
        batch,
        **{
            f.name: getattr(batch, f.name).to(device)
            for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)
        },
    )
