"""A version as the registry describes it (``{wc}:weights:v:<N>``), read defensively.

The hash comes from Redis, so a node checks it like any other input: a hash without
``path`` or with a number that is not a number is a :class:`WeightsError` naming the key,
which a node logs and skips like any other bad version.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from weightcast.contract.errors import VersionGone, WeightsError


@dataclass(frozen=True)
class VersionInfo:
    """The registry hash of one version.

    ``path`` is as registered: relative to the weights root (``v17``) from current
    publishers, absolute from older ones; :class:`~weightcast.client.reader.VersionReader`
    resolves it against the node's own weights root.
    """

    version: int
    path: str
    step: int
    layout: str
    tp: int
    dtype: str
    bytes: int
    manifest_sha256: str
    run_id: str
    created_at: float

    @classmethod
    def from_fields(cls, version: int, raw: Mapping[bytes | str, bytes | str]) -> VersionInfo:
        """Parse a registry hash (as redis-py returns it, or :meth:`as_fields`' output)."""
        fields = {_text(k): _text(v) for k, v in raw.items()}
        values: dict[str, object] = {"version": version}
        for item in dataclasses.fields(cls):
            if item.name == "version":
                continue
            if item.name not in fields:
                raise WeightsError(f"registry entry of version {version} has no {item.name!r}")
            try:
                values[item.name] = _KINDS[item.type](fields[item.name])  # type: ignore[index]
            except ValueError:
                raise WeightsError(
                    f"registry entry of version {version}: {item.name} is "
                    f"{fields[item.name]!r}, not a {item.type}"
                ) from None
        if not values["path"] or len(str(values["manifest_sha256"])) != 64:
            raise WeightsError(
                f"registry entry of version {version} needs a path and a 64-digit manifest_sha256"
            )
        return cls(**values)  # type: ignore[arg-type]

    def as_fields(self) -> dict[str, str]:
        """The hash as strings: what :meth:`from_fields` reads (JSON- and RPC-friendly)."""
        return {k: str(v) for k, v in dataclasses.asdict(self).items() if k != "version"}


_KINDS = {"int": int, "float": float, "str": str}


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def live_info(version: int, raw: Mapping[bytes, bytes], score: float | None) -> VersionInfo:
    """A version's registry hash, if the version is still in the live set."""
    if not raw or score is None:
        raise VersionGone(f"version {version} is not live")
    return VersionInfo.from_fields(version, raw)


def leased_info(version: int, reply: list[bytes] | None) -> VersionInfo:
    """The lease script's reply: the version's hash as a flat list, or nothing if evicted."""
    if not reply:
        raise VersionGone(f"version {version} is no longer live")
    return VersionInfo.from_fields(version, dict(zip(reply[::2], reply[1::2], strict=True)))
