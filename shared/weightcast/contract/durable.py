"""Small filesystem steps that survive a crash: fsynced files, durable renames, trash."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

TRASH_PREFIX = ".trash-"


def write_json(path: Path, data: object) -> None:
    """Write JSON and fsync it, so that a later rename publishes durable bytes."""
    write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode())


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` and fsync it, so that a later rename publishes durable bytes."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory so that its entries (renames, new files) are durable."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename a finished ``tmp`` directory to ``final`` and make the rename durable."""
    os.rename(tmp, final)
    fsync_path(final.parent)


def remove_dir(path: Path) -> None:
    """Take ``path`` out of its namespace with one rename, then delete it.

    A crash mid-delete leaves a ``.trash-*`` directory that :func:`sweep` removes, never a
    half-deleted directory under the original name.
    """
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def sweep(directory: Path, prefixes: tuple[str, ...]) -> list[str]:
    """Delete leftovers (temp and trash directories) whose names start with ``prefixes``."""
    removed = []
    if not directory.is_dir():
        return removed
    for entry in os.scandir(directory):
        if entry.name.startswith(prefixes):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
            removed.append(entry.name)
    return removed
