"""``manifest.json``: what a published version holds and how to check it.

It lists every file with its size and sha256 and every tensor with its shape, dtype, file
and how vLLM shards it. Readers verify files against it before loading anything.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from weightcast.contract.errors import WeightsError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "weightcast.manifest/1"
_CHUNK = 8 * 1024 * 1024


class ManifestError(WeightsError):
    """A version directory that does not match its manifest."""


@dataclass(frozen=True)
class FileEntry:
    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class TensorEntry:
    """One tensor in one file. ``shard`` says how vLLM splits it (see ``layout.rank_slice``).

    ``rank`` is None for a whole tensor. In a version with per-rank files each tensor has one
    entry per rank: ``file`` is that rank's file, ``shape`` the rank's part, ``rank`` its rank.
    """

    name: str
    file: str
    shape: list[int]
    dtype: str
    shard: dict[str, Any]
    rank: int | None = None


@dataclass
class Manifest:
    version: int
    step: int
    run_id: str
    snapshot_id: str
    layout: str
    tp: int
    dtype: str
    files: list[FileEntry] = field(default_factory=list)
    tensors: list[TensorEntry] = field(default_factory=list)
    per_rank_files: bool = False
    """True when each tp rank's parameters are in a file of their own (``rank`` entries)."""
    hf_dir: str | None = None
    """Set when the version also holds the plain HF layout in this subdirectory (``hf``)."""
    format: str = MANIFEST_FORMAT

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        raw = json.loads(text)
        if raw.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"unknown manifest format {raw.get('format')!r}")
        raw["files"] = [FileEntry(**f) for f in raw["files"]]
        raw["tensors"] = [TensorEntry(**t) for t in raw["tensors"]]
        for entry in raw["files"]:
            _check_file_name(entry.name)
        return cls(**raw)

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        return cls.from_json((directory / MANIFEST_NAME).read_bytes())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_entry(path: Path) -> FileEntry:
    return FileEntry(name=path.name, bytes=os.path.getsize(path), sha256=sha256_file(path))


def verify_files(directory: Path, manifest: Manifest) -> None:
    """Check that every listed file exists with the listed size and sha256."""
    for entry in manifest.files:
        path = directory / entry.name
        if not path.is_file():
            raise ManifestError(f"{path}: missing")
        size = os.path.getsize(path)
        if size != entry.bytes:
            raise ManifestError(f"{path}: {size} bytes, manifest says {entry.bytes}")
        if sha256_file(path) != entry.sha256:
            raise ManifestError(f"{path}: sha256 does not match the manifest")


def _check_file_name(name: str) -> None:
    """A file name, or ``<subdir>/<name>`` for the ``hf`` subdirectory; nothing that escapes."""
    parts = name.split("/")
    if len(parts) > 2 or "\\" in name or any(not part or part in (".", "..") for part in parts):
        raise ManifestError(f"manifest names an unsafe file {name!r}")
