"""The trainer reads a step's figures in one device-to-host copy."""

from __future__ import annotations

import math

import pytest
import torch

from weightcast_trainer.train_step import read_figures


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
