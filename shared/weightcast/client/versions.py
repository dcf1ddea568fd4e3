"""The registry's reply about a version, as a node receives it: the version's hash if it is
still live, or :class:`VersionGone`. The hash itself is parsed by
:class:`~weightcast.contract.version_info.VersionInfo`; the lease script's reply by
:class:`~weightcast.contract.leases.Leases`."""

from __future__ import annotations

from collections.abc import Mapping

from weightcast.contract.errors import VersionGone
from weightcast.contract.version_info import VersionInfo


def live_info(version: int, raw: Mapping[bytes, bytes], score: float | None) -> VersionInfo:
    """A version's registry hash, if the version is still in the live set."""
    if not raw or score is None:
        raise VersionGone(f"version {version} is not live")
    return VersionInfo.from_fields(version, raw)
