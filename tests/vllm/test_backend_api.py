"""The backend implements the weight-transfer engine API of the installed vLLM: every
abstract method, with vLLM's parameter names (``receive_weights(update_info)`` on 0.32
and 0.33), so vLLM can build it and call it by keyword."""

from __future__ import annotations

import inspect

from vllm.distributed.weight_transfer.base import WeightTransferEngine

from weightcast.client.vllm.backend import WeightcastWeightTransferEngine


def test_every_abstract_method_is_implemented_with_vllms_parameters() -> None:
    abstract = WeightTransferEngine.__abstractmethods__
    assert "receive_weights" in abstract
    assert not WeightcastWeightTransferEngine.__abstractmethods__
    for name in abstract:
        ours = inspect.signature(getattr(WeightcastWeightTransferEngine, name))
        theirs = inspect.signature(getattr(WeightTransferEngine, name))
        assert list(ours.parameters) == list(theirs.parameters), name
