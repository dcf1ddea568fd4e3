"""The snapshots in the checkpoint directory, as the publisher finds them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcast.contract.errors import WeightcastError
from weightcast.contract.snapshot_format import (
    CONFIG_NAME,
    IncompleteSnapshot,
    SnapshotInfo,
    read_complete,
    snapshot_step,
)


class CorruptSnapshot(WeightcastError, ValueError):
    """A snapshot that cannot be published as it is; the message says why."""


@dataclass(frozen=True)
class Snapshot:
    path: Path
    info: SnapshotInfo

    @property
    def step(self) -> int:
        return self.info.step


def complete_snapshots(checkpoint_dir: Path) -> tuple[list[Snapshot], list[tuple[Path, str]]]:
    """Complete ``step-*`` snapshots, oldest first, and the broken ones with reasons.

    A ``step-*`` directory only appears by the trainer's rename of a finished one, so one
    that is not complete (``contract.snapshots.read_complete``) is damaged, not in progress.
    """
    found: list[Snapshot] = []
    broken: list[tuple[Path, str]] = []
    if not checkpoint_dir.is_dir():
        return found, broken
    for path in checkpoint_dir.iterdir():
        if snapshot_step(path.name) is None or not path.is_dir():
            continue
        try:
            found.append(Snapshot(path, read_complete(path)))
        except IncompleteSnapshot as exc:
            broken.append((path, str(exc)))
    found.sort(key=lambda s: (s.info.created_at, s.step))
    return found, broken


def read_config(snapshot: Snapshot) -> dict[str, Any]:
    try:
        config = json.loads((snapshot.path / CONFIG_NAME).read_text())
    except (OSError, ValueError) as exc:
        raise CorruptSnapshot(f"config.json unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise CorruptSnapshot("config.json is not a JSON object")
    return config
