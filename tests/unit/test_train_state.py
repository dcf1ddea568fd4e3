"""The train state's bookkeeping of applied stream ids, as pure functions and a DCP round trip."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from weightcast_trainer.resume import (
    STATE_KEY,
    TrainState,
    decode_ids,
    encode_ids,
    newest_checkpoint,
    read_train_state,
    remove_partial,
)


def test_stream_ids_round_trip_through_an_int64_tensor() -> None:
    ids = ["1795999169366-0", "1795999169366-1", "0-0", "9223372036854775807-7"]
    tensor = encode_ids(ids)
    assert tensor.dtype == torch.int64 and tensor.shape == (4, 2)
    assert decode_ids(tensor) == ids
    assert encode_ids([]).shape == (0, 2)


def test_trimming_keeps_the_history_and_everything_since_the_last_durable_checkpoint() -> None:
    state = TrainState(history=3)
    state.record(encode_ids([f"{i}-0" for i in range(5)]))
    first = state.checkpointed()  # all five are new since the last checkpoint: none may go
    assert state.applied_ids() == [f"{i}-0" for i in range(5)]
    state.settled(first)
    state.record(encode_ids(["5-0"]))
    held = state.applied_set
    state.settled(state.checkpointed())
    assert state.applied_ids() == ["3-0", "4-0", "5-0"]
    assert held is state.applied_set and held == {"3-0", "4-0", "5-0"}  # updated in place


def test_a_checkpoint_that_failed_trims_nothing_it_should_have_held() -> None:
    state = TrainState(history=2)
    state.record(encode_ids(["0-0", "1-0"]))
    state.settled(state.checkpointed())
    state.record(encode_ids(["2-0", "3-0", "4-0"]))
    state.checkpointed()  # this save fails (a full disk): never settled
    state.record(encode_ids(["5-0"]))
    retry = state.checkpointed()
    assert state.applied_ids() == ["2-0", "3-0", "4-0", "5-0"]  # none in a durable one yet
    state.settled(retry)
    state.record(encode_ids(["6-0"]))
    state.checkpointed()
    assert state.applied_ids() == ["5-0", "6-0"]


def test_a_history_of_zero_keeps_only_what_is_not_durable() -> None:
    state = TrainState(history=0)
    state.record(encode_ids(["0-0"]))
    state.settled(state.checkpointed())
    state.checkpointed()
    assert state.applied_ids() == []


def test_a_saved_train_state_is_found_and_read_back(tmp_path: Path) -> None:
    state = TrainState(history=10)
    state.step, state.run_id = 7, "run-abc"
    state.record(encode_ids(["5-1", "6-0"]))
    dcp.save({STATE_KEY: state.state_dict()}, checkpoint_id=str(tmp_path / "step-7"), no_dist=True)
    (tmp_path / "step-9").mkdir()  # a write that never finished: no .metadata
    assert newest_checkpoint(tmp_path) == (7, tmp_path / "step-7")
    assert remove_partial(tmp_path) == ["step-9"] and not (tmp_path / "step-9").exists()
    loaded = read_train_state(tmp_path / "step-7")
    assert (loaded.step, loaded.run_id, loaded.applied_ids()) == (7, "run-abc", ["5-1", "6-0"])
    assert loaded.applied_set == {"5-1", "6-0"}
