"""The train state in every resume checkpoint: the step and the stream entries already applied.

torchtitan's CheckpointManager saves it beside the model, optimizer and LR schedule, so one
durable checkpoint says both what the weights are and which batches they contain. Entries
are kept as an int64 ``[N, 2]`` tensor of ``(ms, seq)`` stream ids, oldest first, never as
pickled Python objects. Entries are listed once per optimizer step that applied them, so a
duplicate in the log would be a batch trained twice.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from weightcast.contract.errors import WeightcastError
from weightcast.contract.snapshot_format import DCP_METADATA, snapshot_step
from weightcast.contract.streams import parse_stream_id
from weightcast.runtime.config import Config
from weightcast.runtime.durable import fsync_path, remove_dir

STATE_KEY = "train_state"
"""Name ForgeEngine gives the train state in the checkpoint (keys ``train_state.<name>``)."""

RUN_ID_BYTES = 64


def resume_dir(config: Config) -> Path:
    """``trainer.resume_dir``, or ``<checkpoint_dir>-resume`` beside the snapshots (outside
    the publisher's scan)."""
    if config.trainer.resume_dir:
        return Path(config.trainer.resume_dir).absolute()
    snapshots = Path(config.common.checkpoint_dir).absolute()
    return snapshots.with_name(f"{snapshots.name}-resume")


def encode_ids(entry_ids: Iterable[str]) -> torch.Tensor:
    """Stream ids ``"<ms>-<seq>"`` as an int64 ``[N, 2]`` tensor."""
    rows = [parse_stream_id(entry_id) for entry_id in entry_ids]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


def decode_ids(ids: torch.Tensor) -> list[str]:
    return [f"{ms}-{seq}" for ms, seq in ids.tolist()]


class TrainState(Stateful):
    """Step, run id and the log of applied entries, trimmed to the newest ``history``.

    Trimming never drops entries applied since the newest durable checkpoint: those may
    still be pending in Redis, and the log is what tells a restarted trainer not to train
    them again. A checkpoint that fails (a full disk) leaves them untrimmed until one holds
    them.
    """

    def __init__(self, history: int) -> None:
        self.history = history
        self.step = 0
        self.run_id = ""
        self.applied = torch.zeros(0, 2, dtype=torch.int64)
        self.applied_set: set[str] = set()
        self.recorded = 0
        """Entries recorded by this process (a count that only grows)."""
        self.durable = 0
        """:attr:`recorded` when the newest durable checkpoint was taken."""

    def record(self, ids: torch.Tensor) -> None:
        """Add the ``[N, 2]`` ids one optimizer step applied (every rank's, in rank order)."""
        self.applied = torch.cat([self.applied, ids.to(torch.int64).cpu()])
        self.applied_set.update(decode_ids(ids))
        self.recorded += len(ids)

    def applied_ids(self) -> list[str]:
        return decode_ids(self.applied)

    def checkpointed(self) -> int:
        """Trim the log before a checkpoint is taken; entries in durable checkpoints are
        acked. Returns the mark to give :meth:`settled` once this checkpoint is durable."""
        keep = max(self.history, self.recorded - self.durable)
        if len(self.applied) > keep:
            self.applied = self.applied[-keep:].clone() if keep else self.applied[:0].clone()
            self._reset_set()
        return self.recorded

    def settled(self, mark: int) -> None:
        """The checkpoint taken at ``mark`` (from :meth:`checkpointed`) is durable."""
        self.durable = max(self.durable, mark)

    def state_dict(self) -> dict[str, Any]:
        run_id = torch.zeros(RUN_ID_BYTES, dtype=torch.uint8)
        raw = self.run_id.encode()[:RUN_ID_BYTES]
        run_id[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        return {
            "step": torch.tensor(self.step, dtype=torch.int64),
            "applied": self.applied,
            "run_id": run_id,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.applied = state_dict["applied"].clone()
        self._reset_set()
        raw = bytes(state_dict["run_id"].tolist())
        self.run_id = raw.rstrip(b"\0").decode()
        self.recorded = self.durable = 0  # what was loaded is durable

    def _reset_set(self) -> None:
        """Rebuild the id set in place: the batch source holds a reference to it."""
        self.applied_set.clear()
        self.applied_set.update(decode_ids(self.applied))

    def size_for(self, checkpoint: Path) -> None:
        """Give ``applied`` the checkpoint's length so that DCP can load into it."""
        meta = dcp.FileSystemReader(str(checkpoint)).read_metadata()
        size = meta.state_dict_metadata[f"{STATE_KEY}.applied"].size
        self.applied = torch.zeros(tuple(size), dtype=torch.int64)


def newest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    """The complete checkpoint with the highest step (DCP's ``.metadata`` marks it whole)."""
    found = [(step, path) for step, path, complete in _checkpoints(folder) if complete]
    return max(found) if found else None


def remove_partial(folder: Path) -> list[str]:
    """Delete checkpoint directories a crash left without ``.metadata`` (never loadable)."""
    removed = []
    for _, path, complete in _checkpoints(folder):
        if not complete:
            remove_dir(path)
            removed.append(path.name)
    return removed


def _checkpoints(folder: Path) -> Iterator[tuple[int, Path, bool]]:
    """Every ``step-<S>`` entry of ``folder``: its step, path and whether it is complete."""
    if folder.is_dir():
        for entry in os.scandir(folder):
            step = snapshot_step(entry.name)
            if step is not None:
                yield step, Path(entry.path), (Path(entry.path) / DCP_METADATA).is_file()


class IncompleteCheckpoint(WeightcastError):
    """A resume checkpoint whose save returned without ``.metadata``."""


def make_durable(checkpoint: Path) -> None:
    """fsync the checkpoint directory and its parent: DCP fsyncs files, not directories.

    Refuses a checkpoint without ``.metadata``: its entries must not be acknowledged.
    """
    if not (checkpoint / DCP_METADATA).is_file():
        raise IncompleteCheckpoint(
            f"resume checkpoint {checkpoint} has no {DCP_METADATA} after its save returned; "
            "its entries stay unacknowledged and are trained again after a restart"
        )
    fsync_path(checkpoint)
    fsync_path(checkpoint.parent)


def read_train_state(checkpoint: Path) -> TrainState:
    """The train state of one resume checkpoint, read without a model or process group."""
    state = TrainState(history=0)
    state.size_for(checkpoint)
    target = {STATE_KEY: state.state_dict()}
    dcp.load(target, checkpoint_id=str(checkpoint), no_dist=True)
    state.load_state_dict(target[STATE_KEY])
    return state


def read_model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model tensors of one resume checkpoint (torchtitan's names, their saved dtype),
    read without a model or process group: no optimizer, LR schedule or train state."""
    meta = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {
        name: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for name, item in meta.items()
        if hasattr(item, "size") and not name.startswith(("optimizer", "lr_scheduler", "train"))
    }
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state
