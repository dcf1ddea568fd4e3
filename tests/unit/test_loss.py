"""The policy losses as pure functions of logits and a batch."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weightcast.contract.codec import MAX_ABS_ADVANTAGE, RolloutBatch
from weightcast_trainer.loss import (
    KL_LIMIT,
    LossSettings,
    get_loss,
    grpo_loss,
    logprob_mismatch,
    policy_entropy,
    sft_loss,
    token_logprobs,
    trained_tokens,
)

VOCAB = 11


def make_batch(
    mask: list[list[int]], advantages: list[float], **extra: torch.Tensor
) -> tuple[torch.Tensor, RolloutBatch]:
    gen = torch.Generator().manual_seed(1)
    b, t = len(mask), len(mask[0])
    logits = torch.randn(b, t, VOCAB, generator=gen, requires_grad=True)
    batch = RolloutBatch(
        input_ids=torch.randint(0, VOCAB, (b, t), generator=gen),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        advantages=torch.tensor(advantages)[:, None].expand(b, t).contiguous(),
        meta={"policy_version": 0, "producer": "test"},
        **extra,
    )
    return logits, batch


def test_token_logprobs_score_each_token_from_the_logits_before_it() -> None:
    logits, batch = make_batch([[0, 1, 1, 1]], [1.0])
    logp = token_logprobs(logits, batch.input_ids)
    manual = torch.log_softmax(logits, -1)
    assert logp[0, 0] == 0
    for t in range(1, 4):
        assert torch.isclose(logp[0, t], manual[0, t - 1, batch.input_ids[0, t]])


def test_means_weigh_every_trained_token_equally_across_lengths() -> None:
    # Sequence 0 trains 1 token, sequence 1 trains 3: a per-row mean would weigh them 1:1.
    logits, batch = make_batch([[0, 0, 0, 1], [0, 1, 1, 1]], [1.0, 1.0])
    result = sft_loss(logits, batch, LossSettings())
    logp = token_logprobs(logits, batch.input_ids)
    expected = -(logp[0, 3] + logp[1, 1] + logp[1, 2] + logp[1, 3]) / 4
    assert torch.isclose(result.loss, expected)


def test_position_zero_is_never_trained_even_if_masked() -> None:
    logits, batch = make_batch([[1, 1, 0, 0]], [1.0])
    loss = sft_loss(logits, batch, LossSettings()).loss
    assert torch.isclose(loss, -token_logprobs(logits, batch.input_ids)[0, 1])


def test_on_policy_grpo_is_the_advantage_weighted_policy_gradient() -> None:
    logits, batch = make_batch([[0, 1, 1, 0], [0, 0, 1, 1]], [2.0, -0.5])
    result = grpo_loss(logits, batch, LossSettings())
    (grad,) = torch.autograd.grad(result.loss, logits)
    mask = batch.loss_mask.clone()
    mask[:, 0] = 0
    reference = -(batch.advantages * token_logprobs(logits, batch.input_ids) * mask).sum() / 4
    (expected,) = torch.autograd.grad(reference, logits)
    assert torch.allclose(grad, expected, atol=1e-6)
    assert result.loss.item() == pytest.approx(-(2.0 * 2 - 0.5 * 2) / 4)
    assert result.metrics["clip_fraction"] == 0


def test_ratio_is_clipped_against_old_logprobs() -> None:
    logits, batch = make_batch([[0, 1, 1]], [1.0])
    logp = token_logprobs(logits, batch.input_ids).detach()
    # Token 1: ratio e^0.5 > 1.2 with a positive advantage -> clipped, no gradient.
    # Token 2: ratio 1 -> unclipped.
    batch.old_logprobs = logp - torch.tensor([[0.0, 0.5, 0.0]])
    result = grpo_loss(logits, batch, LossSettings(clip_eps=0.2))
    (grad,) = torch.autograd.grad(result.loss, logits)
    assert result.metrics["clip_fraction"] == pytest.approx(0.5)
    assert torch.count_nonzero(grad[0, 0]) == 0  # logits at t=0 predict the clipped token 1
    assert torch.count_nonzero(grad[0, 1]) > 0
    assert result.loss.item() == pytest.approx(-(1.2 + 1.0) / 2, rel=1e-5)


def test_k3_kl_is_zero_at_the_reference_and_positive_away_from_it() -> None:
    logits, batch = make_batch([[0, 1, 1]], [0.0])
    logp = token_logprobs(logits, batch.input_ids).detach()
    batch.ref_logprobs = logp.clone()
    assert grpo_loss(logits, batch, LossSettings(kl_coef=0.1)).metrics["kl"] == pytest.approx(0)
    batch.ref_logprobs = logp + 0.3
    result = grpo_loss(logits, batch, LossSettings(kl_coef=0.1))
    k3 = math.exp(0.3) - 0.3 - 1
    assert result.metrics["kl"] == pytest.approx(k3, rel=1e-5)
    assert result.loss.item() == pytest.approx(0.1 * k3, rel=1e-4)  # advantages are zero


def test_losses_are_chosen_by_name() -> None:
    assert get_loss("grpo") is grpo_loss and get_loss("sft") is sft_loss
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        get_loss("ppo")


def test_entropy_is_the_mean_over_trained_tokens_of_the_next_token_distribution() -> None:
    logits, batch = make_batch([[0, 1, 1, 0], [0, 0, 0, 1]], [1.0, 1.0])
    logp = torch.log_softmax(logits.detach(), -1)
    per_position = -(logp.exp() * logp).sum(-1)  # [B, T]: position t predicts token t + 1
    expected = (per_position[0, 0] + per_position[0, 1] + per_position[1, 2]) / 3
    assert policy_entropy(logits, batch, chunk_rows=2).item() == pytest.approx(expected.item())
    uniform = torch.zeros(2, 4, VOCAB)
    assert policy_entropy(uniform, batch).item() == pytest.approx(math.log(VOCAB), rel=1e-6)


def test_a_users_loss_is_loaded_by_dotted_path() -> None:
    assert get_loss("weightcast_trainer.loss:sft_loss") is sft_loss
    for name, message in (
        ("no_such_module_xyz:fn", "cannot load loss"),
        ("weightcast_trainer.loss:nothing", "cannot load loss"),
        ("weightcast_trainer.loss:LOSSES", "is not callable"),
    ):
        with pytest.raises(ValueError, match=message):
            get_loss(name)


def test_trained_tokens_counts_the_mask_without_position_zero() -> None:
    _, batch = make_batch([[1, 1, 1, 0], [0, 0, 0, 1]], [1.0, 1.0])
    assert trained_tokens(batch) == 3


EXTREME_LOGPROBS = [0.0, -1e-30, -0.5, -7.0, -100.0, -1e4, -3e38]
EXTREME_ADVANTAGES = [-MAX_ABS_ADVANTAGE, -1.0, -1e-30, 0.0, 1e-30, 1.0, MAX_ABS_ADVANTAGE]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logit_scale", [1.0, 1e4])
def test_grpo_is_finite_for_every_batch_the_contract_admits(
    dtype: torch.dtype, logit_scale: float
) -> None:
    """The corners of what validate_tensors admits: log-probabilities from 0 to -3e38 (old
    and reference), advantages at the bound, logits near-uniform or saturated."""
    settings = LossSettings(clip_eps=0.2, kl_coef=1.0, dual_clip=100.0)
    for old in EXTREME_LOGPROBS:
        for advantage in EXTREME_ADVANTAGES:
            logits, batch = make_batch([[0, 1, 1, 1]] * 2, [advantage, -advantage])
            logits = (logits.detach() * logit_scale).to(dtype).requires_grad_()
            batch.old_logprobs = torch.full((2, 4), old)
            batch.ref_logprobs = torch.full((2, 4), old)
            result = grpo_loss(logits, batch, settings)
            (grad,) = torch.autograd.grad(result.loss, logits)
            case = f"old/ref={old} advantage={advantage}"
            assert math.isfinite(result.loss.item()), case
            assert torch.isfinite(grad.float()).all(), case
            assert abs(result.loss.item()) <= 100.0 * MAX_ABS_ADVANTAGE + KL_LIMIT, case


def test_negative_advantages_are_dual_clipped() -> None:
    """Far above pi_old with a negative advantage: the objective stops at dual_clip * A and
    gives no gradient; below dual_clip the PPO objective (and its gradient) is unchanged."""
    logits, batch = make_batch([[0, 1, 1]], [-2.0])
    logp = token_logprobs(logits, batch.input_ids).detach()
    batch.old_logprobs = logp - torch.tensor([[0.0, 50.0, math.log(2.0)]])  # ratios e^50, 2
    result = grpo_loss(logits, batch, LossSettings(clip_eps=0.2, dual_clip=3.0))
    assert result.loss.item() == pytest.approx((3.0 * 2.0 + 2.0 * 2.0) / 2, rel=1e-5)
    assert result.metrics["clip_fraction"] == 1.0  # both ratios lie outside [0.8, 1.2]
    (grad,) = torch.autograd.grad(result.loss, logits)
    assert torch.count_nonzero(grad[0, 0]) == 0  # token 1, dual-clipped
    assert torch.count_nonzero(grad[0, 1]) > 0  # token 2: ratio 2 is unclipped for A < 0


def test_the_kl_estimate_is_clamped_far_from_the_reference() -> None:
    logits, batch = make_batch([[0, 1, 1]], [0.0])
    logp = token_logprobs(logits, batch.input_ids).detach()
    batch.ref_logprobs = logp + 60.0  # exp(60) would be 1e26 per token
    result = grpo_loss(logits, batch, LossSettings(kl_coef=1.0))
    assert result.metrics["kl"] == KL_LIMIT
    assert result.loss.item() == pytest.approx(KL_LIMIT)


def test_the_mismatch_is_zero_on_the_trainers_own_logprobs_and_grows_with_a_wrong_engine() -> None:
    mask = [[0, 1, 1, 1], [0, 0, 1, 1]]
    logits, without = make_batch(mask, [1.0, -1.0])
    assert logprob_mismatch(logits, without) is None
    own = token_logprobs(logits, without.input_ids).detach()
    _, same = make_batch(mask, [1.0, -1.0], old_logprobs=own)
    exact = logprob_mismatch(logits, same)
    assert exact is not None and exact.tokens == 5
    assert exact.kl.item() == 0.0 and exact.max_abs.item() == 0.0
    shifted = own.clone()
    shifted[1, 3] -= 0.5  # one trained token; position 0 of row 0 is never trained
    shifted[0, 0] -= 100.0
    _, wrong = make_batch(mask, [1.0, -1.0], old_logprobs=shifted)
    off = logprob_mismatch(logits, wrong)
    assert off is not None and off.max_abs.item() == pytest.approx(0.5)
    assert off.kl.item() == pytest.approx(math.exp(0.5) - 0.5 - 1)  # k3 of that one token


def unchunked_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The plain computation: a float32 copy of all logits, cross-entropy keeping another."""
    batch, seq = input_ids.shape
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        input_ids[:, 1:].reshape(-1),
        reduction="none",
    )
    return torch.nn.functional.pad(-nll.view(batch, seq - 1), (1, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 4096])
def test_chunked_logprobs_and_their_gradient_equal_the_unchunked_ones(
    dtype: torch.dtype, chunk_rows: int
) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 40, 97, generator=gen) * 4).to(dtype).requires_grad_()
    ids = torch.randint(0, 97, (3, 40), generator=gen)
    upstream = torch.randn(3, 40, generator=gen)
    got = token_logprobs(logits, ids, chunk_rows=chunk_rows)
    want = unchunked_logprobs(logits, ids)
    assert got.dtype == torch.float32 and got.shape == (3, 40)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    (grad,) = torch.autograd.grad((got * upstream).sum(), logits)
    (expected,) = torch.autograd.grad((want * upstream).sum(), logits)
    assert grad.dtype == dtype
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(grad, expected, **tolerance)


def peak_bytes(run: Callable[[], object]) -> int:
    """The most bytes ``run`` held allocated at once on the CPU, beyond what it started
    with (torch's profiler records every allocation and free, in order)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        run()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak


def test_chunked_logprobs_hold_a_chunk_not_a_float32_copy_of_the_logits() -> None:
    """bf16 logits of 2 x 512 x 8192: a float32 copy is 33.5 MB. Chunked, the forward holds
    about a chunk of float32 rows, the backward also the gradient (in the logits' dtype)."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 512, 8192, generator=gen).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, 8192, (2, 512), generator=gen)
    float_copy = logits.numel() * 4
    chunk = 32 * 8192 * 4  # float32 rows: 1/32 of the copy

    def chunked() -> torch.Tensor:
        return token_logprobs(logits, ids, chunk_rows=32)

    def backward(compute: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: torch.autograd.grad(compute().sum(), logits)

    gradient = logits.numel() * logits.element_size()
    assert peak_bytes(chunked) <= 3 * chunk
    assert peak_bytes(backward(chunked)) <= gradient + 3 * chunk
    # The bound catches the plain computation: two float32 copies, then a third backward.
    plain = lambda: unchunked_logprobs(logits, ids)  # noqa: E731
    assert peak_bytes(plain) >= 1.9 * float_copy  # T - 1 rows of each
    assert peak_bytes(backward(plain)) >= gradient + 1.9 * float_copy


def test_a_micro_batchs_figures_never_wait_for_the_device() -> None:
    """Loss, metrics, entropy and mismatch stay tensors: no ``.item()`` (a device sync each)
    and no boolean indexing (``nonzero``, a sync too) until the step reads them all at once."""
    logits, batch = make_batch([[0, 1, 1, 1], [0, 0, 1, 1]], [1.0, -1.0])
    batch.old_logprobs = token_logprobs(logits, batch.input_ids).detach() - 0.1
    batch.ref_logprobs = batch.old_logprobs + 0.2
    seen = SyncingOps()
    with seen:
        result = grpo_loss(logits, batch, LossSettings(kl_coef=0.1))
        figures = [*result.metrics.values(), result.loss, policy_entropy(logits, batch)]
        mismatch = logprob_mismatch(logits, batch)
    assert seen.ops == []
    assert all(isinstance(f, torch.Tensor) and f.dim() == 0 for f in figures)
    assert mismatch is not None and int(mismatch.tokens) == 5


class SyncingOps(TorchDispatchMode):
    """Records the ops that make a CUDA device sync with the host."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "item")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        if name in self.SYNCING:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))
