"""The mismatch of lagged batches: the kept weights of published steps (bounded), swapped into
the model for a forward pass and back, and the score against the weights that sampled."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from weightcast.contract.codec import RolloutBatch
from weightcast_trainer.lagged_mismatch import score_lagged, scored_lags
from weightcast_trainer.loss import logprob_mismatch, token_logprobs, trained_mask
from weightcast_trainer.sampling_weights import (
    SamplingWeights,
    capacity_for,
    swapped,
    version_bytes,
)
from weightcast_trainer.train_step import train_step

from helpers.steps import TinyLM, make_batch, make_parts, process_group_of_one

MASK = [[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    with process_group_of_one():
        yield


def own_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@torch.no_grad()
def move(model: torch.nn.Module, seed: int, by: float = 0.5) -> None:
    """A training step's worth of change (a large one)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * by)


def sampled_by(model: torch.nn.Module, batch: RolloutBatch) -> RolloutBatch:
    """``batch`` with the log-probabilities ``model`` gives its trained tokens, as an engine
    sampling with those weights would report them."""
    with torch.no_grad():
        logp = token_logprobs(model(batch.input_ids), batch.input_ids)
    return dataclasses.replace(
        batch, old_logprobs=torch.where(trained_mask(batch).bool(), logp, 0.0)
    )


def per_token_kl(found: object) -> float:
    assert found is not None
    return float(found.kl / found.tokens)  # type: ignore[attr-defined]


def test_capacity_is_what_the_budget_holds() -> None:
    one = version_bytes(TinyLM())
    assert one == (11 * 8 + 8 * 11 + 11) * 2  # bf16
    assert capacity_for(int(2.5 * one), one) == 2
    assert capacity_for(one - 1, one) == 0
    assert capacity_for(0, one) == 0
    assert capacity_for(100 * one, one, max_policy_lag=2) == 3  # older batches are dropped
    assert capacity_for(2 * one, one, max_policy_lag=8) == 2
    assert capacity_for(100 * one, one, max_policy_lag=-1) == 100


def test_the_steps_kept_never_exceed_the_capacity_and_hold_the_published_weights() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    kept = SamplingWeights(capacity=3)
    for step in range(10):
        move(model, step)
        kept.keep(step, model)
        assert len(kept.steps) <= 3
        assert kept.nbytes <= 3 * version_bytes(model)
        for name, p in model.named_parameters():  # the snapshot's bf16, on the host
            assert torch.equal(kept.get(step)[name], p.detach().to(torch.bfloat16))
    assert kept.steps == [7, 8, 9] and 6 not in kept and 9 in kept
    move(model, 99)
    kept.keep(8, model)  # the same step published again (a restart) replaces it
    assert kept.steps == [7, 9, 8]
    nothing = SamplingWeights(capacity=0)
    nothing.keep(1, model)
    assert nothing.steps == [] and nothing.nbytes == 0


def test_swapped_weights_are_the_kept_ones_inside_and_the_models_own_bitwise_after() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    kept = SamplingWeights(capacity=1)
    kept.keep(1, model)
    move(model, 1)
    before = own_weights(model)
    ids = torch.arange(11)[None]
    with swapped(model, kept.get(1)):
        for name, p in model.named_parameters():
            assert torch.equal(p, kept.get(1)[name].float())
        inside = model(ids)
    with pytest.raises(RuntimeError, match="inside"), swapped(model, kept.get(1)):
        raise RuntimeError("inside")
    after = own_weights(model)
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert not torch.allclose(inside, model(ids))


def test_a_lagged_batch_is_scored_against_the_weights_of_the_step_that_sampled_it() -> None:
    """Sampled with step 1's published (bf16) weights and trained at step 3: ~0 against
    step 1's weights, where the trainer's own weights of step 3 would give far more."""
    torch.manual_seed(0)
    model = TinyLM()
    kept = SamplingWeights(capacity=2)
    move(model, 0)
    kept.keep(0, model)
    move(model, 1)
    kept.keep(1, model)
    with swapped(model, kept.get(1)):
        exact = sampled_by(model, make_batch(MASK, 1))
    move(model, 2)
    kept.keep(3, model)  # step 0 leaves the two kept
    wrong = sampled_by(model, make_batch(MASK, 2))  # step 3's weights, tagged step 1
    gone = sampled_by(model, make_batch(MASK, 3))
    live = make_batch(MASK, 4)
    bare = dataclasses.replace(make_batch(MASK, 5), old_logprobs=None)
    before = own_weights(model)
    batches = [exact, wrong, gone, live, bare]
    scored = score_lagged(make_parts(model), kept, batches, [1, 1, 0, 3, 1], current=3)

    assert per_token_kl(scored[0]) < 1e-10
    with torch.no_grad():  # the check could fail: the live weights are far from step 1's
        assert per_token_kl(logprob_mismatch(model(exact.input_ids), exact)) > 1e-2
    assert per_token_kl(scored[1]) > 1e-2
    assert scored[2:] == [None, None, None]  # not kept, lag 0 (the step scores it), no logprobs
    assert scored_lags(batches, [1, 1, 0, 3, 1], 3, scored) == [2, 2, None, 0, None]
    off = score_lagged(make_parts(model), SamplingWeights(0), [exact], [1], current=3)
    assert off == [None]  # trainer.mismatch_memory_mb 0: lag 0 only
    after = own_weights(model)
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_the_step_reports_the_lagged_mismatch_with_the_on_policy_one() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    kept = SamplingWeights(capacity=1)
    kept.keep(0, model)
    with swapped(model, kept.get(0)):  # the engine serves the published bf16 weights
        lagged = sampled_by(model, make_batch(MASK, 1))
    move(model, 1)
    parts = make_parts(model)
    scored = score_lagged(parts, kept, [lagged], [0], current=1)
    outcome = train_step(parts, [lagged], 1, [False], scored)
    assert outcome.applied
    assert outcome.metrics["mismatch_kl"] == pytest.approx(per_token_kl(scored[0]))
    assert outcome.metrics["mismatch_kl"] < 1e-10 and outcome.metrics["mismatch_max"] < 1e-5
