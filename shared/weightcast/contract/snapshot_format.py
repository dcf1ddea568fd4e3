"""The checkpoint directory contract between the trainer and the publisher.

The trainer writes each model-only snapshot under ``.tmp-step-<S>/`` and renames it to
``step-<S>/`` when complete, so a ``step-*`` directory is always whole. It holds the model's
HF ``config.json``, the tensors under their HF names (a tied ``lm_head`` left out), and
``weightcast.json``, the :class:`SnapshotInfo` that identifies it and says its format:

``dcp-safetensors/1`` (:data:`FORMAT_DCP_SAFETENSORS`, what the trainer writes)
    DCP with safetensors storage (``HuggingFaceStorageWriter`` with ``save_distributed``):
    each rank writes its own blocks of rows to ``shard-<rank+1:05d>-model-00001-of-00001
    .safetensors``, a plain safetensors file whose ``__metadata__["DCP_SHARDING_INFO"]``
    (:data:`SHARDING_INFO_KEY`) is JSON ``{name: {"saved_offsets": [row, 0, ...]}}``: where
    each block starts in the full tensor. Everything a reader needs is in those headers; no
    pickle. DCP's HF writer writes no ``.metadata``; instead ``weightcast.json`` lists every
    data file with its size (``files``). The trainer's rank 0 writes it only after ``dcp.save``
    returned, which happens only after every rank's files were written and fsynced.

``dcp-torchsave`` (:data:`FORMAT_DCP_TORCH_SAVE`, earlier trainers; ``weightcast.json``
    without ``format``) DCP's ``FileSystemWriter``: ``__<rank>_<i>.distcp`` files of
    ``torch.save`` records and DCP's pickled ``.metadata``. Readers load it with ``dcp.load``.

Completeness (:func:`read_complete`): ``config.json`` and ``weightcast.json`` exist, and
either the format is ``dcp-safetensors/1`` and every listed file exists with exactly its
listed size, or it is ``dcp-torchsave`` and ``.metadata`` exists. The listing, not the
directory, says which files make the snapshot: a missing rank file is an incomplete snapshot,
never a model with fewer rows. Whether the files' headers agree (every tensor tiled by its
blocks, no gap, no overlap) is the reader's check.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from weightcast.contract.errors import WeightcastError
from weightcast.contract.untrusted import json_object

SNAPSHOT_PREFIX = "step-"
TMP_PREFIX = ".tmp-"
INFO_NAME = "weightcast.json"
CONFIG_NAME = "config.json"
DCP_METADATA = ".metadata"

FORMAT_DCP_SAFETENSORS = "dcp-safetensors/1"
FORMAT_DCP_TORCH_SAVE = "dcp-torchsave"
FORMATS = (FORMAT_DCP_SAFETENSORS, FORMAT_DCP_TORCH_SAVE)
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
"""Header metadata key of a ``dcp-safetensors`` file (DCP's own name for it)."""

_SNAPSHOT = re.compile(r"^step-(\d+)$")


class IncompleteSnapshot(WeightcastError, ValueError):
    """A ``step-*`` directory that lacks something the contract requires; says what."""


@dataclass(frozen=True)
class SnapshotFile:
    """A data file of a ``dcp-safetensors`` snapshot: its name in the directory and size."""

    name: str
    bytes: int


@dataclass(frozen=True)
class SnapshotInfo:
    """Who wrote a snapshot, when and how; ``snapshot_id`` is unique per written snapshot."""

    snapshot_id: str
    run_id: str
    step: int
    created_at: float
    dtype: str
    model: str
    format: str = FORMAT_DCP_TORCH_SAVE
    files: tuple[SnapshotFile, ...] = ()
    """Every data file (``dcp-safetensors`` only), in name order."""

    def to_json(self) -> dict[str, object]:
        """What ``weightcast.json`` holds (written with :func:`weightcast.runtime.durable
        .write_json`, the last file of a snapshot)."""
        return asdict(self)

    @classmethod
    def read(cls, directory: Path) -> SnapshotInfo:
        """Parse ``weightcast.json``; ValueError or TypeError when it is not one."""
        raw = json_object((directory / INFO_NAME).read_bytes(), INFO_NAME, ValueError)
        raw.setdefault("format", FORMAT_DCP_TORCH_SAVE)
        if raw["format"] not in FORMATS:
            raise ValueError(
                f"unknown snapshot format {raw['format']!r}; this weightcast reads "
                f"{', '.join(FORMATS)} (upgrade the publisher)"
            )
        files = tuple(SnapshotFile(**entry) for entry in raw.pop("files", ()))
        for entry in files:
            unsafe = "/" in entry.name or entry.name in ("", ".", "..")
            if unsafe or type(entry.bytes) is not int:
                raise ValueError(f"unsafe or malformed file entry {entry}")
        return cls(**raw, files=files)


def snapshot_name(step: int) -> str:
    return f"{SNAPSHOT_PREFIX}{step}"


def snapshot_step(name: str) -> int | None:
    """The step of a complete snapshot directory name, or None for anything else."""
    match = _SNAPSHOT.match(name)
    return int(match.group(1)) if match else None


def data_file_name(rank: int) -> str:
    """The data file rank ``rank`` writes (DCP's HF writer's name for shard ``rank + 1``)."""
    return f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"


def read_complete(directory: Path) -> SnapshotInfo:
    """The snapshot's info once it is complete; :class:`IncompleteSnapshot` says what lacks."""
    for name in (INFO_NAME, CONFIG_NAME):
        if not (directory / name).is_file():
            raise IncompleteSnapshot(f"incomplete: {name} missing")
    try:
        info = SnapshotInfo.read(directory)
    except (OSError, ValueError, TypeError) as exc:
        raise IncompleteSnapshot(f"{INFO_NAME} unreadable: {exc}") from None
    if info.format == FORMAT_DCP_TORCH_SAVE:
        if not (directory / DCP_METADATA).is_file():
            raise IncompleteSnapshot(f"incomplete: {DCP_METADATA} missing")
        return info
    if not info.files:
        raise IncompleteSnapshot(f"incomplete: {INFO_NAME} lists no data files")
    for entry in info.files:
        try:
            size = os.stat(directory / entry.name).st_size
        except FileNotFoundError:
            raise IncompleteSnapshot(f"incomplete: data file {entry.name} missing") from None
        if size != entry.bytes:
            raise IncompleteSnapshot(
                f"incomplete: {entry.name} has {size} bytes, {INFO_NAME} says {entry.bytes}"
            )
    return info
