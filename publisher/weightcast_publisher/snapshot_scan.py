"""The snapshots in the checkpoint directory, as the publisher finds them."""

from __future__ import annotations

import json
import os
import shutil
import stat
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
from weightcast.runtime.durable import trash_path


class CorruptSnapshot(WeightcastError, ValueError):
    """A snapshot that cannot be published as it is; the message says why."""


DirId = tuple[int, int]
"""A directory's (st_dev, st_ino): which directory a name named when the scan read it."""


@dataclass(frozen=True)
class Snapshot:
    path: Path
    info: SnapshotInfo
    dir_id: DirId | None = None

    @property
    def step(self) -> int:
        return self.info.step


@dataclass(frozen=True)
class Broken:
    """A ``step-*`` directory that is not a complete snapshot, and the one it was."""

    path: Path
    reason: str
    dir_id: DirId


def dir_id(path: Path) -> DirId | None:
    """The directory ``path`` names now; None when it names none."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def complete_snapshots(checkpoint_dir: Path) -> tuple[list[Snapshot], list[Broken]]:
    """Complete ``step-*`` snapshots, oldest first, and the broken ones with reasons.

    A ``step-*`` directory only appears by the trainer's rename of a finished one, so one
    that is not complete (``contract.snapshots.read_complete``) is damaged, not in progress.
    One that was replaced or removed while it was read (the trainer writing a step again
    after a restart, the old one deleted) is neither: it is left to the next scan.
    """
    found: list[Snapshot] = []
    broken: list[Broken] = []
    if not checkpoint_dir.is_dir():
        return found, broken
    for path in checkpoint_dir.iterdir():
        before = dir_id(path) if snapshot_step(path.name) is not None else None
        if before is None:
            continue
        try:
            info: SnapshotInfo | str = read_complete(path)
        except IncompleteSnapshot as exc:
            info = str(exc)
        if dir_id(path) != before:
            continue
        if isinstance(info, str):
            broken.append(Broken(path, info, before))
        else:
            found.append(Snapshot(path, info, before))
    found.sort(key=lambda s: (s.info.created_at, s.step))
    return found, broken


def set_aside(path: Path, judged: DirId | None, target: Path) -> bool:
    """Move the directory judged at ``path`` to ``target``; False, nothing moved, when
    ``path`` names another directory by now (the step was written again) or none.

    The move comes first and the check after, since a check before it would leave a gap; a
    newer snapshot moved by mistake is renamed straight back.
    """
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return False
    if judged is None or dir_id(target) == judged:
        return True
    os.rename(target, path)
    return False


def discard(snapshot: Snapshot) -> None:
    """Delete a handled snapshot, but not a newer one written to its step since the scan."""
    trash = trash_path(snapshot.path)
    if set_aside(snapshot.path, snapshot.dir_id, trash):
        shutil.rmtree(trash, ignore_errors=True)


def read_config(snapshot: Snapshot) -> dict[str, Any]:
    try:
        config = json.loads((snapshot.path / CONFIG_NAME).read_text())
    except (OSError, ValueError) as exc:
        raise CorruptSnapshot(f"config.json unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise CorruptSnapshot("config.json is not a JSON object")
    return config
