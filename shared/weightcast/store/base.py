"""What a weights store is: where versions live, for the publisher that writes them and the
nodes that read them.

A store holds one directory of files per version (``v17/``: ``manifest.json``, ``config.json``,
the weights files, the delta), named by the registry's ``path`` relative to the store's root.
Two transports implement it, one file each: a directory every node mounts
(:mod:`weightcast.store.directory`: the publisher's weights directory itself) and an
S3-compatible object store (:mod:`weightcast.store.s3`); :func:`weightcast.store.factory.open_store`
picks one from the configured location. Both implement the publisher's side too
(:class:`WritableStore`: write a version, remove it, trim it, clean what a crash left), and
:class:`~weightcast.store.mirror.MirroredStore` is the weights directory mirrored to a bucket:
the one store a publisher holds (:func:`weightcast.store.factory.publisher_store`).

Nodes trust a store no more than they trust a shared directory: a version's files are
checked against the manifest, whose sha256 is in Redis, and every block against its digest.
So a store only has to hand over bytes; it promises nothing about them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Protocol, Self

from weightcast.contract.errors import WeightsError
from weightcast.contract.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    sha256_bytes,
    sha256_file,
)

Identity = tuple[str | int, ...]
"""What tells a stored file from another one stored later under the same name (a directory
file's device, inode, size and times; an object's ETag, size and modification time): blocks
verified in a file of one identity count for nothing in a file of another."""


class StoredFile(Protocol):
    """One file of a version, open for reading at any offset."""

    label: str
    """Where it is, for messages (a path, or ``s3://bucket/key``; never a credential)."""
    identity: Identity

    @property
    def size(self) -> int: ...

    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        """Fill ``buffers``, in order, with the bytes from ``offset`` on; a file that ends
        early (or changes while it is read) is a WeightsError."""
        ...

    def read_at(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


class StoredVersion(Protocol):
    """A version's files, open while a node reads them."""

    label: str

    def open(self, name: str, expected_bytes: int | None = None) -> StoredFile:
        """The plain file ``name`` of the version, of the size the manifest gives (when
        given); anything else (a path, a link, a missing file) is a WeightsError."""
        ...

    def read_small(self, name: str, limit: int, expected_bytes: int | None = None) -> bytes:
        """All of a small file (a manifest, a config), refused above ``limit`` bytes before
        anything is read."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


class Store(ABC):
    """Where nodes read versions from."""

    label: str
    """The store's root, for logs and messages (never a credential)."""

    @abstractmethod
    def check(self) -> None:
        """Fail now, in one line, if this process can never use the store (no such bucket,
        a refused credential: :class:`StoreAccessDenied`), rather than at the first version."""

    @abstractmethod
    def open_version(self, path: str) -> StoredVersion:
        """The version at the registry's ``path`` (``v17``), relative to the root; a path that
        leaves the root is a WeightsError."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and threads."""


class PartUpload(Protocol):
    """One file of a version sent part by part as the publisher's writer produces it."""

    def part(self, number: int, data: bytes | memoryview) -> None:
        """Send part ``number`` (1-based, any order, every part but the last of one size);
        ``data`` may be reused by the caller once this returns."""
        ...

    def complete(self) -> None:
        """Every part was given: the file exists in the store from now on."""
        ...

    def abort(self) -> None:
        """Give the file up (best effort)."""
        ...


class VersionWrite(Protocol):
    """One version on its way into a store, from :meth:`WritableStore.begin_version` on: the
    publisher's writer writes the version's files in a directory, hands each weights file's
    parts over as it writes them, then finishes it from that directory."""

    def file(self, name: str) -> PartUpload | None:
        """Where the parts of the version's file ``name`` go as the writer produces them;
        None when the store takes the file from the written directory (or holds it there
        already) at :meth:`finish`."""
        ...

    def finish(self, local: Path) -> int:
        """Make the complete local version directory ``local`` the store's version (a
        directory renames it into place; a bucket receives its files but those sent part by
        part already, ``manifest.json`` last); how many files it sent (0: the store is that
        directory). Nothing is registered yet: a failure or a kill leaves what
        :meth:`WritableStore.remove_version` and :meth:`WritableStore.remove_unfinished`
        remove."""
        ...

    def abort(self) -> None:
        """Give the version up (best effort): what was written, the files being sent, and
        what was sent."""
        ...


class LocalVersionWrite(VersionWrite, Protocol):
    """A version written in the publisher's weights directory (the write of
    :class:`~weightcast.store.directory.DirectoryStore` and of
    :class:`~weightcast.store.mirror.MirroredStore`): the writer writes its files in
    :attr:`directory`, and ``finish(directory)`` puts it at :attr:`final`."""

    directory: Path
    """Where the writer writes the version's files (``.tmp-v<N>/``)."""
    final: Path
    """Where the version is once finished (``v<N>/``): the next version's delta base."""


HELD = "held"
"""What :meth:`WritableStore.restore_version` says: the store holds the version."""
RESTORED = "restored"
"""... it lacked it and has it now, from the publisher's copy."""
LOST = "lost"
"""... it lacks it, and the publisher's copy is not that version either."""


class WritableStore(Store):
    """A store the publisher writes versions to, removes them from and cleans: the weights
    directory itself (:class:`~weightcast.store.directory.DirectoryStore`), a bucket
    (:class:`~weightcast.store.s3.S3Store`), or the weights directory mirrored to a bucket
    (:class:`~weightcast.store.mirror.MirroredStore`)."""

    @abstractmethod
    def begin_version(self, name: str) -> VersionWrite:
        """Start writing version ``name`` (``v17``)."""

    @abstractmethod
    def remove_version(self, name: str) -> None:
        """Remove version ``name``'s files (evicted, or never registered)."""

    @abstractmethod
    def trim_version(self, name: str, keep: Collection[str]) -> None:
        """Remove every file of version ``name`` but those named in ``keep`` (a delta-only
        version keeps its manifest, config and delta)."""

    @abstractmethod
    def version_names(self) -> list[str]:
        """The names of the version directories the store holds."""

    @abstractmethod
    def remove_unfinished(self) -> list[str]:
        """Remove what an interrupted write left that is not a version (temp and trash
        directories, unfinished multipart uploads); what it removed, for a log line."""

    def restore_version(self, name: str, local: Path, manifest_sha256: str) -> str:
        """Make sure the store holds version ``name`` with the registered manifest
        (``manifest_sha256``): when it lacks it (the deployment moved to a new bucket, or the
        bucket was emptied), it is written again from the publisher's complete copy ``local``,
        what an interrupted write of it left replaced. :data:`HELD` (nothing to do),
        :data:`RESTORED`, or :data:`LOST` (``local`` is not that version either)."""
        if self.manifest_sha256(name) == manifest_sha256:
            return HELD
        manifest = local / MANIFEST_NAME
        if not manifest.is_file() or sha256_file(manifest) != manifest_sha256:
            return LOST
        self.remove_version(name)
        self.begin_version(name).finish(local)
        return RESTORED

    def manifest_sha256(self, name: str) -> str:
        """The SHA-256 of version ``name``'s manifest here; empty when it has none."""
        try:
            with self.open_version(name) as stored:
                return sha256_bytes(stored.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES))
        except WeightsError:
            return ""
