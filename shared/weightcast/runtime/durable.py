"""Small filesystem steps that survive a crash: fsynced files, durable renames, trash."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import uuid
from pathlib import Path

TRASH_PREFIX = ".trash-"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM)
"""What renameat2 answers where the kernel, the filesystem or a seccomp filter lacks it."""
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)


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


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap two existing directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``), so
    that both names always name a directory; False where the system or filesystem cannot."""
    if _renameat2 is None:  # not glibc >= 2.28 (macOS, musl)
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def replace_dir(tmp: Path, final: Path) -> bool:
    """Put a finished ``tmp`` directory in place of the existing ``final``, then delete the old.

    Atomic where :func:`exchange_dirs` works: ``final`` names the old directory, then the new
    one, never nothing. Elsewhere it takes two renames (the old one out, the new one in), and
    a reader may find ``final`` gone or changed in between. True when it was atomic.
    """
    if exchange_dirs(tmp, final):
        fsync_path(final.parent)
        remove_dir(tmp)  # the old directory, under the temp name since the swap
        return True
    remove_dir(final)
    publish_dir(tmp, final)
    return False


def remove_dir(path: Path) -> None:
    """Take ``path`` out of its namespace with one rename, then delete it.

    A crash mid-delete leaves a ``.trash-*`` directory that :func:`sweep` removes, never a
    half-deleted directory under the original name.
    """
    trash = trash_path(path)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def trash_path(path: Path) -> Path:
    """A fresh name beside ``path`` for it on its way out, one that :func:`sweep` finds."""
    return path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")


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
