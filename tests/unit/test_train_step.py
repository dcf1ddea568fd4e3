"""One optimizer step on a tiny model, in a world of one: loss scaling, figures read in one
device-to-host copy, and the steps that are not applied."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch

from weightcast.contract.codec import RolloutBatch
from weightcast_trainer.loss import LossFn, LossResult, LossSettings, grpo_loss
from weightcast_trainer.train_step import StepTotals, read_figures, train_step

from helpers.steps import TinyLM, make_batch, make_parts, process_group_of_one


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    with process_group_of_one():
        yield


def joined(batches: list[RolloutBatch]) -> RolloutBatch:
    """One batch holding every sequence of ``batches``."""
    return RolloutBatch(
        **{
            name: torch.cat([getattr(b, name) for b in batches])
            for name in ("input_ids", "loss_mask", "advantages", "old_logprobs")
        },
        meta={"policy_version": 0},
    )


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


SHORT = [[0, 0, 1, 1, 0, 0]]  # trains 2 tokens
LONG = [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]  # trains 3 + 4


def test_micro_batches_add_up_to_one_big_batch_and_idle_passes_add_nothing() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    whole = copy.deepcopy(model)
    before = weights(model)
    batches = [make_batch(SHORT, 1), make_batch(LONG, 2)]

    split = train_step(make_parts(model), batches, passes=3, on_policy=[False, False])
    big = train_step(make_parts(whole), [joined(batches)], passes=1, on_policy=[False])

    assert split.applied and big.applied and split.finite == [True, True]
    for name, start in before.items():
        moved, expected = weights(model)[name] - start, weights(whole)[name] - start
        assert moved.abs().sum() > 0
        torch.testing.assert_close(moved, expected, rtol=1e-5, atol=1e-6)
    for name in ("loss", "entropy", "clip_fraction", "grad_norm"):
        assert split.metrics[name] == pytest.approx(big.metrics[name], rel=1e-5, abs=1e-7)
    assert split.metrics["tokens"] == 6 + 12 and split.metrics["lr"] == 1.0


def test_the_mismatch_is_measured_on_the_batches_marked_on_policy_only() -> None:
    torch.manual_seed(0)
    batches = [make_batch(SHORT, 1), make_batch(LONG, 2)]
    off = train_step(make_parts(TinyLM()), batches, passes=2, on_policy=[False, False])
    on = train_step(make_parts(TinyLM()), batches, passes=2, on_policy=[False, True])
    assert "mismatch_kl" not in off.metrics and "mismatch_max" not in off.metrics
    assert on.metrics["mismatch_kl"] > 0 and on.metrics["mismatch_max"] > 0


def poisoned(logits: torch.Tensor, batch: RolloutBatch, settings: LossSettings) -> LossResult:
    result = grpo_loss(logits, batch, settings)
    if batch.meta.get("poison"):
        return LossResult(result.loss * float("nan"), result.metrics)
    return result


def infinite_gradient(
    logits: torch.Tensor, batch: RolloutBatch, settings: LossSettings
) -> LossResult:
    """A finite loss whose gradient is not: sqrt's slope at 0 times 0."""
    result = grpo_loss(logits, batch, settings)
    return LossResult(result.loss + (logits.sum() * 0.0).sqrt(), result.metrics)


@pytest.mark.parametrize(
    ("loss", "finite", "loss_failed"),
    [(poisoned, [True, False], True), (infinite_gradient, [True, True], False)],
)
def test_a_step_that_is_not_finite_changes_nothing(
    loss: LossFn, finite: list[bool], loss_failed: bool
) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    before = weights(model)
    updates: list[None] = []
    parts = dataclasses.replace(make_parts(model, loss), before_update=lambda: updates.append(None))
    batches = [make_batch(SHORT, 1), make_batch(LONG, 2, poison=True)]

    outcome = train_step(parts, batches, passes=2, on_policy=[False, False])

    assert not outcome.applied
    assert outcome.finite == finite and outcome.loss_failed_somewhere is loss_failed
    assert all(torch.equal(weights(model)[k], v) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())
    assert parts.lr_schedulers.schedulers[0].last_epoch == 0 and not updates
    assert "lr" not in outcome.metrics and not math.isfinite(outcome.metrics["grad_norm"])
    if loss_failed:  # the loss that was not finite weighs nothing in the step's figures
        assert math.isfinite(outcome.metrics["loss"]) and outcome.metrics["tokens"] == 18


def test_totals_weigh_each_figure_by_trained_tokens_and_skip_failed_losses() -> None:
    totals = StepTotals()
    totals.add({"loss": 1.0, "kl": 0.5}, trained=2, inputs=6, finite=True)
    totals.add({"loss": 4.0}, trained=6, inputs=12, finite=True)
    totals.add({"loss": math.nan, "kl": math.nan}, trained=9, inputs=9, finite=False)
    totals.add_mismatch(kl=0.3, tokens=3, max_abs=0.2)
    totals.add_mismatch(kl=0.1, tokens=1, max_abs=0.7)

    reduced = totals.over_ranks(torch.device("cpu"))

    assert reduced == totals  # a world of one: the sums are this rank's
    assert reduced.input_tokens == 27 and reduced.failed_losses == 1
    assert reduced.means() == pytest.approx(
        {"loss": (2 * 1.0 + 6 * 4.0) / 8, "kl": 0.5, "mismatch_kl": 0.1, "mismatch_max": 0.7}
    )
    assert StepTotals().over_ranks(torch.device("cpu")).means() == {}


def test_every_tensor_is_read_as_a_float_in_place_and_plain_numbers_pass() -> None:
    rows = [
        {"loss": torch.tensor(0.5), "clip_fraction": 0.25, "entropy": torch.tensor([2.0])},
        {"loss": torch.tensor(float("nan")), "kl": 3},
        {"grad_norm": torch.tensor(7.0, dtype=torch.bfloat16)},
    ]
    read = read_figures(rows, torch.device("cpu"))
    assert read[0] == {"loss": 0.5, "clip_fraction": 0.25, "entropy": 2.0}
    assert math.isnan(read[1]["loss"]) and read[1]["kl"] == 3.0
    assert read[2] == {"grad_norm": 7.0}
    assert all(type(v) is float for row in read for v in row.values())
    assert read_figures([{"a": 1.0}], torch.device("cpu")) == [{"a": 1.0}]


def test_a_metric_of_several_values_is_refused_naming_it() -> None:
    rows = [{"loss": torch.tensor(1.0), "per_token": torch.ones(3)}]
    with pytest.raises(ValueError, match="loss metric 'per_token' is a tensor of 3 values"):
        read_figures(rows, torch.device("cpu"))
