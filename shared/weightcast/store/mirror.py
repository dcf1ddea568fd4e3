"""The publisher's weights directory mirrored to a bucket: the one store of a publisher whose
nodes read an object store.

Every version is written in the directory first
(:class:`~weightcast.store.directory.DirectoryWrite`: it is the next version's delta base,
read from the page cache), its weights files sent to the bucket as the writer writes them, the
rest once the directory holds it whole (:class:`MirroredWrite`); it is removed and trimmed in
the bucket first, then in the directory. Nodes read the bucket.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from weightcast.store.base import PartUpload, StoredVersion, VersionWrite, WritableStore
from weightcast.store.directory import DirectoryStore, DirectoryWrite


class MirroredStore(WritableStore):
    """``local`` (the publisher's weights directory) mirrored to ``remote`` (a bucket)."""

    def __init__(self, local: DirectoryStore, remote: WritableStore) -> None:
        self.local = local
        self.remote = remote
        self.label = remote.label

    def check(self) -> None:
        self.remote.check()

    def open_version(self, path: str) -> StoredVersion:
        """The version as nodes read it: from the bucket."""
        return self.remote.open_version(path)

    def close(self) -> None:
        self.remote.close()

    def begin_version(self, name: str) -> MirroredWrite:
        return MirroredWrite(self.local.begin_version(name), self.remote.begin_version(name))

    def remove_version(self, name: str) -> None:
        self.remote.remove_version(name)
        self.local.remove_version(name)

    def trim_version(self, name: str, keep: Collection[str]) -> None:
        self.remote.trim_version(name, keep)
        self.local.trim_version(name, keep)

    def version_names(self) -> list[str]:
        """The versions either copy holds."""
        return sorted(set(self.local.version_names()) | set(self.remote.version_names()))

    def remove_unfinished(self) -> list[str]:
        return self.local.remove_unfinished() + self.remote.remove_unfinished()

    def restore_version(self, name: str, local: Path, manifest_sha256: str) -> str:
        """Upload ``local`` again when the bucket lacks the version."""
        return self.remote.restore_version(name, local, manifest_sha256)


class MirroredWrite:
    """A version written in the directory (``local``) and sent to the bucket (``remote``)."""

    def __init__(self, local: DirectoryWrite, remote: VersionWrite) -> None:
        self.local = local
        self.remote = remote
        self.directory = local.directory
        self.final = local.final

    def file(self, name: str) -> PartUpload | None:
        return self.remote.file(name)

    def finish(self, local: Path) -> int:
        """Put ``local`` in place in the directory, then send the rest of it from there."""
        self.local.finish(local)
        return self.remote.finish(self.final)

    def abort(self) -> None:
        self.remote.abort()
        self.local.abort()
