"""The directory transport: versions in a directory every node mounts.

Open only what a node may read: plain names inside the weights root, never via a symlink.

The registry names a version directory (``v17``, or an absolute path from older publishers)
and its manifest names files. Both come from outside the node, so neither is trusted as a
path: :func:`registered_parts` turns the registry's ``path`` into plain names below the
weights root, :class:`VersionDir` opens the root and then each of those names relative to
the directory before it (``openat``) with ``O_NOFOLLOW``, and every file relative to the
version directory, again with ``O_NOFOLLOW``, then checks with ``fstat`` that it is a regular
file. A ``..``, an absolute name or a symlink anywhere (the version directory, the manifest,
a weights file) is refused, so nothing outside the weights root is ever opened.

The publisher's side (:class:`DirectoryStore` as a :class:`~weightcast.store.base.WritableStore`)
is the weights directory itself, and this module is where a version is written there,
removed and trimmed: written in ``.tmp-v<N>/`` and renamed whole to ``v<N>/``
(:class:`DirectoryWrite`), removed by renaming it away first
(:func:`~weightcast.runtime.durable.remove_dir`), trimmed to its delta by swapping in a trimmed
copy (:meth:`DirectoryStore.trim_version`); what a kill left is swept by its temp and trash
names (:meth:`DirectoryStore.remove_unfinished`).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Self

from weightcast.contract.errors import WeightsError
from weightcast.contract.version_info import TMP_VERSION_PREFIX, dir_version
from weightcast.runtime.durable import (
    TRASH_PREFIX,
    exchange_dirs,
    fsync_path,
    publish_dir,
    remove_dir,
    sweep,
    trash_path,
)
from weightcast.store.base import HELD, Identity, PartUpload, WritableStore

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
"""``O_NONBLOCK``: opening a FIFO planted under a weights name must not hang the node (it is
refused by the ``fstat`` check right after); it changes nothing for regular files."""
_IOV_MAX = os.sysconf("SC_IOV_MAX")


def plain_name(name: object, what: str) -> str:
    """``name`` if it is one plain file name (no ``/``, not ``.`` or ``..``, no NUL)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise WeightsError(f"{what} {name!r}: not a plain file name; refusing to open it")
    return name


def registered_parts(path: str, root: Path, root_as_given: Path) -> tuple[str, ...]:
    """The plain names that lead from the weights root to the registry's ``path``.

    A relative path (what the publisher writes: ``v17``) is taken below the root. An
    absolute one (older publishers) must lie inside the root, as this node sees it either
    resolved (``root``) or as configured (``root_as_given``). ``..`` and ``.`` are refused
    anywhere, so the names are exactly what will be opened.
    """
    if path.startswith("/"):
        for base in (root, root_as_given):
            prefix = str(base).rstrip("/") + "/"
            if path.startswith(prefix):
                path = path[len(prefix) :]
                break
        else:
            raise WeightsError(
                f"registered path {path} is outside the weights root {root}; refusing to read it"
            )
    parts = tuple(path.split("/"))
    for part in parts:
        if part in ("", ".", "..") or "\0" in part:
            raise WeightsError(
                f"registered path {path!r} is not plain names below the weights root "
                f"{root}; refusing to read it"
            )
    return parts


def file_identity(info: os.stat_result) -> Identity:
    """What ``fstat`` says about an open file; a changed file has a different identity."""
    return ("file", info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class _Descriptor:
    """Something opened: ``close()`` it, or use it in a ``with`` block."""

    fd: int

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OpenFile(_Descriptor):
    """A regular file opened inside a version directory."""

    def __init__(self, fd: int, label: str, info: os.stat_result) -> None:
        self.fd = fd
        self.label = label
        self.identity = file_identity(info)
        self.size = info.st_size

    def read_at(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``."""
        data = bytearray(length)
        self.read_into([memoryview(data)], offset)
        return bytes(data)

    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        """Fill ``buffers``, in order, with the bytes from ``offset`` on (``preadv``); a file
        that ends early is a WeightsError."""
        pending = [b for b in buffers if len(b)]
        first, at = 0, offset
        while first < len(pending):
            got = os.preadv(self.fd, pending[first : first + _IOV_MAX], at)
            if got == 0:
                wanted = offset + sum(len(b) for b in buffers)
                raise WeightsError(
                    f"{self.label}: ends at {at} bytes, before {wanted} "
                    "(the file shrank while it was read)"
                )
            at += got
            while got and got >= len(pending[first]):
                got -= len(pending[first])
                first += 1
            if got:
                pending[first] = pending[first][got:]


class VersionDir(_Descriptor):
    """A version directory, opened name by name from the weights root without symlinks."""

    def __init__(self, root: Path, parts: tuple[str, ...]) -> None:
        self.label = str(root.joinpath(*parts))
        fd = _open(str(root), _DIR_FLAGS, None, f"weights root {root}")
        for index, part in enumerate(parts):
            try:
                where = f"version directory {root.joinpath(*parts[: index + 1])}"
                next_fd = _open(part, _DIR_FLAGS, fd, where)
            finally:
                os.close(fd)
            fd = next_fd
        self.fd = fd

    def open(self, name: str, expected_bytes: int | None = None) -> OpenFile:
        """Open the plain file ``name`` here: a regular file, not a symlink, of the size the
        manifest gives (when given)."""
        label = f"{self.label}/{plain_name(name, 'file')}"
        fd = _open(name, _FILE_FLAGS, self.fd, label)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise WeightsError(f"{label}: not a regular file; refusing to read it")
            if expected_bytes is not None and info.st_size != expected_bytes:
                raise WeightsError(
                    f"{label}: {info.st_size} bytes, the manifest says {expected_bytes}"
                )
        except BaseException:
            os.close(fd)
            raise
        return OpenFile(fd, label, info)

    def read_small(self, name: str, limit: int, expected_bytes: int | None = None) -> bytes:
        """All of a small file (a manifest, a config), refused above ``limit`` bytes before
        anything is read."""
        with self.open(name, expected_bytes) as f:
            if f.size > limit:
                raise WeightsError(
                    f"{f.label}: {f.size} bytes, more than the {limit} a {name} may have"
                )
            return f.read_at(0, f.size)


def _open(name: str, flags: int, dir_fd: int | None, label: str) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (
            exc.errno == errno.ENOTDIR and flags & os.O_DIRECTORY and _is_symlink(name, dir_fd)
        ):
            raise WeightsError(f"{label}: a symbolic link; refusing to follow it") from None
        raise WeightsError(f"{label}: cannot open it: {exc.strerror}") from None


def _is_symlink(name: str, dir_fd: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


class DirectoryStore(WritableStore):
    """Versions in a directory: the publisher's weights directory, as each node mounts it."""

    def __init__(self, root: Path | str) -> None:
        given = Path(os.path.normpath(Path(root).absolute()))
        self.root = given.resolve()
        self.root_as_given = given
        self.label = str(self.root)

    def check(self) -> None:
        """Nothing: a directory not mounted yet may appear later (nodes wait for versions)."""

    def path(self, path: str) -> Path:
        """Where the registry's ``path`` is on this node (inside the root, or a WeightsError)."""
        return self.root.joinpath(*registered_parts(path, self.root, self.root_as_given))

    def open_version(self, path: str) -> VersionDir:
        return VersionDir(self.root, registered_parts(path, self.root, self.root_as_given))

    def close(self) -> None:
        """Nothing is held open between versions."""

    # The publisher

    def begin_version(self, name: str) -> DirectoryWrite:
        """Start writing version ``name`` (``v17``) in ``.tmp-v17/``, created empty."""
        return DirectoryWrite(self.root, name)

    def remove_version(self, name: str) -> None:
        """Remove every file of version ``name`` (its directory, renamed away first)."""
        remove_dir(self.root / plain_name(name, "version directory"))

    def trim_version(self, name: str, keep: Collection[str]) -> None:
        """Trim version ``name``'s directory to the files in ``keep``, atomically where the
        filesystem swaps directories: a trimmed copy (hard links to the same files) is built
        aside and exchanged with ``v<N>/`` in one step, so ``v<N>/`` is always the whole
        directory or the trimmed one, the kept files the same inodes in both. Elsewhere the
        other files are removed in place (no lease is live on the version and no node reads
        more than the kept files of a delta-only version). A no-op on a trimmed directory."""
        final = self.root / plain_name(name, "version directory")
        try:
            extra = [e for e in os.scandir(final) if e.name not in keep]
        except FileNotFoundError:
            return
        if not extra:
            return
        # Built as .tmp-v<N>-delta-only/: a name the new leader's sweep of temp directories
        # removes.
        tmp = self.root / f".tmp-{name}-delta-only"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            for file in sorted(keep):
                if (final / file).is_file():
                    os.link(final / file, tmp / file)
            fsync_path(tmp)
            swapped = exchange_dirs(tmp, final)
        except OSError:
            swapped = False
        if swapped:
            fsync_path(self.root)
            remove_dir(tmp)  # the whole directory, under the temp name since the swap
            return
        shutil.rmtree(tmp, ignore_errors=True)
        for entry in extra:  # no atomic swap here: remove the other files in place
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False):
                os.rename(path, aside := trash_path(path))
                shutil.rmtree(aside, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        fsync_path(final)

    def version_names(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if dir_version(e.name) is not None)
        except FileNotFoundError:
            return []

    def remove_unfinished(self) -> list[str]:
        """Remove the temp and trash directories a crash left."""
        return sweep(self.root, (TMP_VERSION_PREFIX, TRASH_PREFIX))

    def restore_version(self, name: str, local: Path, manifest_sha256: str) -> str:
        """Nothing to restore: this directory is the publisher's copy itself."""
        return HELD


class DirectoryWrite:
    """Version ``name`` on its way into the weights directory ``root``: the writer writes its
    files in :attr:`directory` (``.tmp-v<N>/``, each file fsynced by whoever writes it; what a
    kill leaves there is swept at the next start), which :meth:`finish` makes durable and
    renames to :attr:`final` (``v<N>/``) in one step
    (:func:`~weightcast.runtime.durable.publish_dir`), so a ``v<N>/`` directory is always
    whole; :meth:`abort` removes it. Nothing is sent: the writer's files are the version."""

    def __init__(self, root: Path, name: str) -> None:
        number = dir_version(plain_name(name, "version directory"))
        if number is None:
            raise WeightsError(f"{name!r}: not a version directory name (v<N>)")
        self.final = root / name
        """Where the version is once finished: the next version's delta base."""
        self.directory = root / f"{TMP_VERSION_PREFIX}{number}"
        """Where the writer writes the version's files until :meth:`finish`."""
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(parents=True)

    def file(self, name: str) -> PartUpload | None:
        """None: the file is written in :attr:`directory`, nothing to send."""
        return None

    def finish(self, local: Path) -> int:
        """Make ``local`` (:attr:`directory`, every file in it written and fsynced) the version
        ``v<N>/``: its directories fsynced, then renamed into place, the rename made durable.
        Sends nothing (0). A failure removes ``local``: no half version is left behind."""
        try:
            for sub in sorted(p for p in local.rglob("*") if p.is_dir()):
                fsync_path(sub)
            fsync_path(local)
            publish_dir(local, self.final)
        except BaseException:
            shutil.rmtree(local, ignore_errors=True)
            raise
        return 0

    def abort(self) -> None:
        """Remove the unfinished version (:attr:`directory`) and what was written in it."""
        shutil.rmtree(self.directory, ignore_errors=True)
