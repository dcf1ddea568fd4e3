"""Policy losses on token log-probabilities, as pure functions of logits and a batch.

Position ``t`` of every per-token tensor is about token ``t``, predicted from tokens before
it, so the logits at ``t - 1`` score token ``t`` and position 0 is never trained. Means are
taken over the trained tokens of the whole micro-batch (each response token weighs the same,
whatever the length of its sequence), never over padding.

The built-in losses are finite for every batch the contract admits (log-probabilities
``<= 0``, advantages within ``+-MAX_ABS_ADVANTAGE``, everything finite): the log-ratio is
clamped before it is exponentiated, negative advantages are dual-clipped, and the KL
estimate is clamped. docs/trainer.md derives the bounds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from weightcast.contract.codec import RolloutBatch

LOG_RATIO_LIMIT = 20.0
"""``|log pi - log pi_old|`` is clamped to this before ``exp``: the ratio stays within
``[e^-20, e^20]`` (about 2e-9 to 5e8), finite in float32 and bfloat16. Beyond
``log(1 + clip_eps)`` and ``log(dual_clip)`` the objective is clipped anyway, so the clamp
takes away no gradient the clipped objective has."""

KL_LIMIT = 10.0
"""The per-token k3 KL estimate is clamped to ``[0, KL_LIMIT]`` (as verl's ``low_var_kl``)."""


@dataclass(frozen=True)
class LossSettings:
    clip_eps: float = 0.2
    """PPO-style clipping of the importance ratio to ``[1 - eps, 1 + eps]``."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate against ``ref_logprobs`` (when the batch has them)."""
    dual_clip: float = 3.0
    """Dual-clip PPO (Ye et al. 2020): with a negative advantage the per-token objective is
    never below ``dual_clip * advantage``, however large the ratio grows."""


@dataclass
class LossResult:
    loss: torch.Tensor
    """The mean over the batch's trained tokens (the trainer weighs micro-batches by them)."""
    metrics: dict[str, float | torch.Tensor]
    """Named figures, each a float or a 0-dim tensor; the trainer reads every tensor of a
    step in one device-to-host copy, so a loss should not call ``.item()`` itself."""


LossFn = Callable[[torch.Tensor, RolloutBatch, LossSettings], LossResult]


CHUNK_ROWS = 1024
"""Rows of logits (positions) turned into float32 at a time: at a 151936 vocabulary, 0.6 GB
per chunk, whatever ``B x T``."""


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, chunk_rows: int = CHUNK_ROWS
) -> torch.Tensor:
    """``[B, T]`` float32 log-probability of each token under the logits before it (0 at
    t = 0), differentiable in ``logits``.

    Computed ``chunk_rows`` positions at a time, forward and backward
    (:class:`_ChunkedLogprobs`): no float32 copy of all the logits is ever made, and the
    backward keeps only a float32 log-normaliser per position, so the memory beyond the
    logits and their gradient is bounded by the chunk, not by ``T x vocab``.
    """
    batch, seq = input_ids.shape
    rows = logits.reshape(batch * seq, logits.shape[-1])
    # Row (b, t) scores token t + 1; the last row of each sequence scores nothing (its
    # output is dropped below, so it gets no gradient).
    targets = F.pad(input_ids[:, 1:], (0, 1)).reshape(-1)
    scored = _ChunkedLogprobs.apply(rows, targets, chunk_rows)
    return F.pad(scored.view(batch, seq)[:, :-1], (1, 0))


class _ChunkedLogprobs(torch.autograd.Function):
    """``log_softmax(rows)[i, targets[i]]`` in float32, chunk by chunk; the backward
    recomputes each chunk's softmax from the saved log-normaliser instead of keeping it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        rows: torch.Tensor,
        targets: torch.Tensor,
        chunk_rows: int,
    ) -> torch.Tensor:
        scored = torch.empty(len(rows), dtype=torch.float32, device=rows.device)
        normaliser = torch.empty_like(scored)
        for start in range(0, len(rows), chunk_rows):
            chunk = rows[start : start + chunk_rows].float()
            lse = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(1, targets[start : start + chunk_rows, None]).squeeze(1)
            scored[start : start + chunk_rows] = picked - lse
            normaliser[start : start + chunk_rows] = lse
        ctx.save_for_backward(rows, targets, normaliser)
        ctx.chunk_rows = chunk_rows  # type: ignore[attr-defined]
        return scored

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        rows, targets, normaliser = ctx.saved_tensors  # type: ignore[attr-defined]
        step = ctx.chunk_rows  # type: ignore[attr-defined]
        grad_rows = torch.empty_like(rows)
        for start in range(0, len(rows), step):
            weight = grad[start : start + step, None].float()
            chunk = rows[start : start + step].to(torch.float32, copy=True)  # changed below
            # d(x_target - logsumexp(x)) / dx = onehot(target) - softmax(x)
            chunk.sub_(normaliser[start : start + step, None]).exp_().mul_(-weight)
            chunk.scatter_add_(1, targets[start : start + step, None], weight)
            grad_rows[start : start + step] = chunk
        return grad_rows, None, None


def trained_mask(batch: RolloutBatch) -> torch.Tensor:
    """The loss mask with position 0 cleared: nothing predicts the first token."""
    mask = batch.loss_mask.clone()
    mask[:, 0] = 0
    return mask


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1; what lies elsewhere (even inf) never counts."""
    return torch.where(mask.bool(), values, 0.0).sum() / mask.sum().clamp(min=1)


def trained_tokens(batch: RolloutBatch) -> int:
    """How many tokens a batch trains: the weight of its loss in an accumulated step."""
    return int(trained_mask(batch).sum().item())


@torch.no_grad()
def policy_entropy(
    logits: torch.Tensor, batch: RolloutBatch, chunk_rows: int = CHUNK_ROWS
) -> torch.Tensor:
    """Mean entropy of the next-token distribution over the trained tokens (a 0-dim tensor
    on the logits' device: reading it is the caller's one sync).

    Computed in row chunks, weighted by the mask rather than indexed by it: no float32 copy
    of all logits, no copy of the trained rows, no device sync.
    """
    rows = logits.reshape(-1, logits.shape[-1])
    # Row (b, t) predicts token t + 1: it counts when that token is trained.
    weights = F.pad(trained_mask(batch)[:, 1:], (0, 1)).reshape(-1).to(torch.float32)
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for start in range(0, len(rows), chunk_rows):
        logp = torch.log_softmax(rows[start : start + chunk_rows].float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        total += (entropy * weights[start : start + chunk_rows]).sum()
    return total / weights.sum().clamp(min=1)


def grpo_loss(logits: torch.Tensor, batch: RolloutBatch, settings: LossSettings) -> LossResult:
    """Clipped policy-gradient loss with optional k3 KL to a reference policy.

    With ``old_logprobs`` the ratio ``pi / pi_old`` is clipped as in PPO, and dual-clipped for
    negative advantages; without them the batch is taken as on-policy (ratio 1, the plain
    policy gradient). Per token the objective is bounded by ``max(1 + clip_eps, dual_clip)
    * |advantage|``, whatever the log-probabilities.
    """
    logp = token_logprobs(logits, batch.input_ids)
    mask = trained_mask(batch)
    advantages = batch.advantages
    behaviour = batch.old_logprobs if batch.old_logprobs is not None else logp.detach()
    ratio = torch.exp((logp - behaviour).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    clipped = ratio.clamp(1 - settings.clip_eps, 1 + settings.clip_eps)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    floor = settings.dual_clip * advantages
    dual_clipped = (advantages < 0) & (objective < floor)
    objective = torch.where(dual_clipped, floor, objective)
    per_token = -objective
    metrics: dict[str, float | torch.Tensor] = {
        "clip_fraction": masked_mean(((ratio != clipped) | dual_clipped).float(), mask).detach()
    }
    if batch.ref_logprobs is not None:
        kl = k3_kl(logp, batch.ref_logprobs)
        metrics["kl"] = masked_mean(kl.detach(), mask)
        if settings.kl_coef:
            per_token = per_token + settings.kl_coef * kl
    loss = masked_mean(per_token, mask)
    return LossResult(loss, metrics)


def k3_kl(logp: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(pi || ref) per token, clamped to ``[0, KL_LIMIT]``."""
    delta = (ref_logprobs - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.exp(delta) - delta - 1).clamp(0.0, KL_LIMIT)


@dataclass(frozen=True)
class Mismatch:
    """How far the engine's log-probabilities of the sampled tokens (``old_logprobs``) are
    from the trainer's own, over the trained tokens, before the update. Each figure is a
    0-dim tensor on the logits' device (no sync until the step reads them all)."""

    kl: torch.Tensor
    """Sum over the trained tokens of the k3 estimate of KL(engine || trainer)."""
    max_abs: torch.Tensor
    """Largest absolute difference of a token's log-probability (0 without trained tokens)."""
    tokens: torch.Tensor
    """How many trained tokens were compared."""


def logprob_mismatch(logits: torch.Tensor, batch: RolloutBatch) -> Mismatch | None:
    """The train/inference mismatch of ``batch`` under ``logits`` (None without
    ``old_logprobs``). For a batch sampled from the very weights the trainer holds, it
    measures only numerics (bf16, kernels); a wrong load shows as a far larger KL."""
    if batch.old_logprobs is None:
        return None
    mask = trained_mask(batch).bool()
    logp = token_logprobs(logits.detach(), batch.input_ids)
    engine = batch.old_logprobs
    # In float64: for the differences of a right load (1e-6) k3 is about 1e-13, which
    # float32's exp(d) - d - 1 rounds to 0.
    kl = torch.where(mask, k3_kl(engine.double(), logp.double()), 0.0).sum()
    gap = torch.where(mask, (logp - engine).abs(), 0.0).amax()
    return Mismatch(kl, gap, mask.sum())


def sft_loss(logits: torch.Tensor, batch: RolloutBatch, settings: LossSettings) -> LossResult:
    """Negative log-likelihood of the trained tokens (advantages are ignored)."""
    logp = token_logprobs(logits, batch.input_ids)
    return LossResult(-masked_mean(logp, trained_mask(batch)), {})


LOSSES: dict[str, LossFn] = {"grpo": grpo_loss, "sft": sft_loss}


def get_loss(name: str) -> LossFn:
    """A built-in loss by name, or a user's ``"package.module:function"`` with its signature.

    A user's function takes ``(logits, batch, settings)`` and returns a :class:`LossResult`
    whose ``loss`` is a mean over the batch's trained tokens.
    """
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            loss = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load loss {name!r}: {exc}") from None
        if not callable(loss):
            raise ValueError(f"loss {name!r} is not callable")
        return loss
    if name not in LOSSES:
        raise ValueError(
            f"unknown loss {name!r}; available: {', '.join(LOSSES)}, or 'package.module:function'"
        )
    return LOSSES[name]
