"""A version as the registry describes it (``{wc}:weights:v:<N>``), parsed once, strictly.

The hash comes from Redis, so a node checks it like any other input: a hash without
``path``, a count that is not plain decimal digits (no sign, ``_``, spaces or other
scripts' digits), a ``tp`` below 1, a ``created_at`` that is not a finite number or a
``manifest_sha256`` that is not 64 hex digits is a :class:`WeightsError` naming the field,
which a node logs and skips like any other bad version.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from weightcast.contract.errors import WeightsError


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
    delta_from: int = 0
    """The version whose delta was written beside this one (0: none, or an older publisher)."""
    delta_bytes: int = 0
    """The size of that delta."""

    @classmethod
    def from_fields(cls, version: int, raw: Mapping[bytes | str, bytes | str]) -> VersionInfo:
        """Parse a registry hash (as redis-py returns it, or :meth:`as_fields`' output)."""
        fields = {_text(k): _text(v) for k, v in raw.items()}
        values: dict[str, object] = {"version": version}
        for item in dataclasses.fields(cls):
            if item.name == "version":
                continue
            if item.name not in fields and item.default is not dataclasses.MISSING:
                continue  # written from format 3 on; older entries have none
            if item.name not in fields:
                raise WeightsError(f"registry entry of version {version} has no {item.name!r}")
            try:
                values[item.name] = _KINDS[item.type](fields[item.name])  # type: ignore[index]
            except ValueError:
                raise WeightsError(
                    f"registry entry of version {version}: {item.name} is "
                    f"{fields[item.name]!r}, not a {item.type}"
                ) from None
        info = cls(**values)  # type: ignore[arg-type]
        if not info.path or not _SHA256.fullmatch(info.manifest_sha256):
            raise WeightsError(
                f"registry entry of version {version} needs a path and a 64-digit manifest_sha256"
            )
        if info.tp < 1:
            raise WeightsError(f"registry entry of version {version}: tp is {info.tp}, not >= 1")
        if info.delta_from >= version or (info.delta_bytes and not info.delta_from):
            raise WeightsError(
                f"registry entry of version {version}: delta_from {info.delta_from} with "
                f"delta_bytes {info.delta_bytes} (a delta comes from an earlier version)"
            )
        return info

    def as_fields(self) -> dict[str, str]:
        """The hash as strings: what :meth:`from_fields` reads (JSON- and RPC-friendly)."""
        return {k: str(v) for k, v in dataclasses.asdict(self).items() if k != "version"}


def _count(text: str) -> int:
    """A non-negative integer in plain decimal digits (``int`` also takes ``-1``, ``1_0``,
    `` 7 `` and other scripts' digits)."""
    if not _DIGITS.fullmatch(text):
        raise ValueError(text)
    return int(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


_DIGITS = re.compile(r"[0-9]{1,19}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KINDS: dict[str, Callable[[str], object]] = {"int": _count, "float": _finite, "str": str}


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
