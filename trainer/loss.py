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
    metrics: dict[str, float]


LossFn = Callable[[torch.Tensor, RolloutBatch, LossSettings], LossResult]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probability of each token under the logits before it (0 at t = 0)."""
    batch, seq = input_ids.shape
    nll = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        input_ids[:, 1:].reshape(-1),
        reduction="none",
    )
    return F.pad(-nll.view(batch, seq - 1), (1, 0))


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
    logits: torch.Tensor, batch: RolloutBatch, chunk_rows: int = 1024
) -> torch.Tensor:
    """Mean entropy of the next-token distribution over the trained tokens.

    Computed in row chunks, so a 150k vocabulary never needs a float32 copy of all logits.
    """
    rows = logits[:, :-1][trained_mask(batch)[:, 1:].bool()]
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for chunk in rows.split(chunk_rows):
        chunk = chunk.float()
        logp = torch.log_softmax(chunk, dim=-1)
        total += -(logp.exp() * logp).sum()
    return total / max(len(rows), 1)


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
    metrics = {
        "clip_fraction": masked_mean(((ratio != clipped) | dual_clipped).float(), mask).item()
    }
    if batch.ref_logprobs is not None:
        kl = k3_kl(logp, batch.ref_logprobs)
        metrics["kl"] = masked_mean(kl.detach(), mask).item()
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
    from the trainer's own, over the trained tokens, before the update."""

    kl: torch.Tensor
    """Sum over the trained tokens of the k3 estimate of KL(engine || trainer)."""
    max_abs: torch.Tensor
    """Largest absolute difference of a token's log-probability."""
    tokens: int


def logprob_mismatch(logits: torch.Tensor, batch: RolloutBatch) -> Mismatch | None:
    """The train/inference mismatch of ``batch`` under ``logits`` (None without
    ``old_logprobs``). For a batch sampled from the very weights the trainer holds, it
    measures only numerics (bf16, kernels); a wrong load shows as a far larger KL."""
    if batch.old_logprobs is None:
        return None
    mask = trained_mask(batch).bool()
    logp = token_logprobs(logits.detach(), batch.input_ids)[mask]
    engine = batch.old_logprobs[mask]
    if engine.numel() == 0:
        return None
    kl = k3_kl(engine, logp).sum()
    return Mismatch(kl, (logp - engine).abs().max(), int(engine.numel()))


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
