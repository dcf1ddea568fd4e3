"""Reads a trainer snapshot without building the model and without a process group."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from weightcast.contract.snapshots import CONFIG_NAME, SnapshotInfo, is_complete, snapshot_step


class CorruptSnapshot(ValueError):
    """A snapshot that cannot be published as it is; the message says why."""


@dataclass(frozen=True)
class Snapshot:
    path: Path
    info: SnapshotInfo

    @property
    def step(self) -> int:
        return self.info.step


def complete_snapshots(checkpoint_dir: Path) -> tuple[list[Snapshot], list[tuple[Path, str]]]:
    """Complete ``step-*`` snapshots, oldest first, and the unreadable ones with reasons."""
    found: list[Snapshot] = []
    broken: list[tuple[Path, str]] = []
    if not checkpoint_dir.is_dir():
        return found, broken
    for path in checkpoint_dir.iterdir():
        if snapshot_step(path.name) is None or not path.is_dir():
            continue
        if not is_complete(path):
            broken.append((path, "incomplete: .metadata, config.json or weightcast.json missing"))
            continue
        try:
            found.append(Snapshot(path, SnapshotInfo.read(path)))
        except (OSError, ValueError, TypeError) as exc:
            broken.append((path, f"weightcast.json unreadable: {exc}"))
    found.sort(key=lambda s: (s.info.created_at, s.step))
    return found, broken


def read_config(snapshot: Snapshot) -> dict[str, Any]:
    try:
        return json.loads((snapshot.path / CONFIG_NAME).read_text())
    except (OSError, ValueError) as exc:
        raise CorruptSnapshot(f"config.json unreadable: {exc}") from None


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` (its own format); damage raises :class:`CorruptSnapshot`."""
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # DCP raises assorted errors on a damaged .metadata
        raise CorruptSnapshot(f".metadata unreadable: {type(exc).__name__}: {exc}") from None


def load_tensors(snapshot: Snapshot, metadata: Metadata | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the snapshot as full CPU tensors, however many ranks wrote it."""
    metadata = read_metadata(snapshot.path) if metadata is None else metadata
    state = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        for name, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, storage_reader=dcp.FileSystemReader(snapshot.path), no_dist=True)
    except Exception as exc:  # truncated or missing data files surface as various errors
        last = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        raise CorruptSnapshot(f"tensor data unreadable: {last[0]}") from None
    return state
