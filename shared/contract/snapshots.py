"""The checkpoint directory contract between the trainer and the publisher.

The trainer writes each model-only snapshot under ``.tmp-step-<S>/`` and renames it to
``step-<S>/`` when complete, so a ``step-*`` directory is always whole. Beside DCP's files
(``.metadata`` is DCP's own completion mark) it holds the model's HF ``config.json`` and
``weightcast.json``, the :class:`SnapshotInfo` that identifies it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from weightcast.contract.durable import write_json

SNAPSHOT_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
INFO_NAME = "weightcast.json"
CONFIG_NAME = "config.json"
DCP_METADATA = ".metadata"

_SNAPSHOT = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class SnapshotInfo:
    """Who wrote a snapshot and when; ``snapshot_id`` is unique per written snapshot."""

    snapshot_id: str
    run_id: str
    step: int
    created_at: float
    dtype: str
    model: str

    def write(self, directory: Path) -> None:
        write_json(directory / INFO_NAME, asdict(self))

    @classmethod
    def read(cls, directory: Path) -> SnapshotInfo:
        return cls(**json.loads((directory / INFO_NAME).read_text()))


def snapshot_name(step: int) -> str:
    return f"{SNAPSHOT_PREFIX}{step}"


def snapshot_step(name: str) -> int | None:
    """The step of a complete snapshot directory name, or None for anything else."""
    match = _SNAPSHOT.match(name)
    return int(match.group(1)) if match else None


def is_complete(directory: Path) -> bool:
    return all((directory / name).is_file() for name in (DCP_METADATA, CONFIG_NAME, INFO_NAME))
