"""What a weights store is: where versions live, for the publisher that writes them and the
nodes that read them.

A store holds one directory of files per version (``v17/``: ``manifest.json``, ``config.json``,
the weights files, the delta), named by the registry's ``path`` relative to the store's root.
Two transports implement it, one file each: a directory every node mounts
(:mod:`weightcast.store.directory`: the publisher's weights directory itself) and an
S3-compatible object store (:mod:`weightcast.store.s3`, a :class:`RemoteStore` the publisher
mirrors each version to); :func:`weightcast.store.factory.open_store` picks one from the
configured location.

Nodes trust a store no more than they trust a shared directory: a version's files are
checked against the manifest, whose sha256 is in Redis, and every block against its digest.
So a store only has to hand over bytes; it promises nothing about them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Protocol, Self

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


class RemoteStore(Store):
    """A store that is not the publisher's weights directory: the publisher writes each
    version there first (the next delta's base) and then mirrors it here."""

    @abstractmethod
    def open_upload(self, name: str, file: str) -> PartUpload:
        """Start sending ``file`` of version ``name`` as it is written."""

    @abstractmethod
    def upload_version(self, name: str, local: Path, uploaded: Collection[str] = ()) -> None:
        """Make the complete local version directory ``local`` the store's version ``name``:
        its files but those ``uploaded`` already (:meth:`open_upload`), ``manifest.json``
        last. Nothing is registered yet: a failure or a kill leaves what
        :meth:`remove_version` and :meth:`remove_unfinished` remove."""

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
    def remove_unfinished(self) -> int:
        """Remove what an interrupted upload left that is not a version (unfinished
        multipart uploads); how many."""
