"""The store a location names: a directory, or an ``s3://`` URL; the store a publisher writes."""

from __future__ import annotations

from pathlib import Path

from weightcast.contract.errors import ConfigError
from weightcast.store.base import Store, WritableStore
from weightcast.store.directory import DirectoryStore
from weightcast.store.mirror import MirroredStore

PublisherStore = DirectoryStore | MirroredStore
"""The store a publisher holds: versions are written in its weights directory either way."""

SCHEMES = ("s3",)
"""The object stores weightcast reads and writes; any other ``scheme://`` is refused."""


def open_store(location: str | Path | Store, retry_seconds: float = 60.0) -> Store:
    """The store at ``location``: a store as it is, ``s3://bucket/prefix[?options]``
    (:class:`~weightcast.store.s3.S3Store`), or a directory path."""
    if isinstance(location, Store):
        return location
    text = str(location)
    scheme, sep, _ = text.partition("://")
    if not sep:
        return DirectoryStore(location)
    if scheme != "s3":
        raise ConfigError(
            f"weights location {scheme}://...: weightcast stores versions in a directory or "
            f"in an S3-compatible bucket ({', '.join(s + '://' for s in SCHEMES)}); for GCS "
            "or Azure use their S3-compatible endpoint with endpoint_url"
        )
    from weightcast.store.s3 import S3Location, S3Store  # boto3 only where S3 is used

    return S3Store(S3Location.parse(text), retry_seconds=retry_seconds)


def publisher_store(
    weights_dir: str | Path, location: str = "", retry_seconds: float = 60.0
) -> PublisherStore:
    """The one store a publisher writes: its weights directory, or (``location`` an object
    store nodes read) that directory mirrored to it
    (:class:`~weightcast.store.mirror.MirroredStore`)."""
    local = DirectoryStore(weights_dir)
    if not location:
        return local
    remote = open_store(location, retry_seconds)
    if not isinstance(remote, WritableStore) or isinstance(remote, DirectoryStore):
        raise ConfigError(f"weights location {location}: not an object store to mirror to")
    return MirroredStore(local, remote)
