"""A version as the registry describes it (``{wc}:weights:v:<N>``), parsed once, strictly,
and the name of its directory.

The publisher writes the hash (:meth:`VersionInfo.as_fields`); nodes, the trainer,
``weightcast status`` and ``weightcast up`` read it (:meth:`VersionInfo.from_fields`). It
comes from Redis, so every reader checks it like any other input: a hash without ``path``, a
count that is not plain decimal digits (no sign, ``_``, spaces or other scripts' digits), a
``tp`` below 1, a ``created_at`` that is not a finite number or a ``manifest_sha256`` that is
not 64 hex digits is a :class:`WeightsError` naming the field, which a node logs and skips
like any other bad version.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from weightcast.contract.errors import WeightsError
from weightcast.contract.untrusted import HashFields


@dataclass(frozen=True, kw_only=True)
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
    """Unix time of the registration."""
    delta_from: int = 0
    """The version whose delta was written beside this one (0: none, or an older publisher)."""
    delta_bytes: int = 0
    """The size of that delta."""
    snapshot_id: str = ""
    """The snapshot the version was converted from (empty: not said)."""
    snapshot_created_at: float = 0.0
    """When the trainer wrote that snapshot (0: not said)."""
    per_rank_files: bool = False
    """One file per tensor-parallel rank rather than one fused file."""
    hf_path: str = ""
    """The HF copy of the ``both`` layout (``v17/hf``); empty without one."""
    no_delta: str = ""
    """Why the version has no delta from the one before although it had a base (the delta
    stopped paying, its encoding fell behind the write, the base differs...); empty when it
    has one or there was no base. Operators see it; nodes need not read it."""

    @classmethod
    def from_fields(cls, version: int, raw: Mapping[bytes | str, bytes | str]) -> VersionInfo:
        """Parse a registry hash (as redis-py returns it, or :meth:`as_fields`' output).
        Fields from ``delta_from`` on are optional: older publishers wrote none of them."""
        fields = HashFields(raw, f"registry entry of version {version}", WeightsError)
        info = cls(
            version=version,
            path=fields.text("path"),
            step=fields.integer("step"),
            layout=fields.text("layout"),
            tp=fields.integer("tp"),
            dtype=fields.text("dtype"),
            bytes=fields.integer("bytes"),
            manifest_sha256=fields.text("manifest_sha256"),
            run_id=fields.text("run_id"),
            created_at=fields.number("created_at"),
            delta_from=fields.integer("delta_from", 0),
            delta_bytes=fields.integer("delta_bytes", 0),
            snapshot_id=fields.text("snapshot_id", ""),
            snapshot_created_at=fields.number("snapshot_created_at", 0.0),
            per_rank_files=fields.flag("per_rank_files", False),
            hf_path=fields.text("hf_path", ""),
            no_delta=fields.text("no_delta", ""),
        )
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
        """The hash as the publisher writes it, all text: what :meth:`from_fields` reads
        (JSON- and RPC-friendly). ``hf_path`` only when there is an HF copy, ``no_delta`` only
        when a delta was dropped."""
        fields = {
            "path": self.path,
            "step": str(self.step),
            "layout": self.layout,
            "tp": str(self.tp),
            "dtype": self.dtype,
            "bytes": str(self.bytes),
            "manifest_sha256": self.manifest_sha256,
            "run_id": self.run_id,
            "snapshot_id": self.snapshot_id,
            "snapshot_created_at": repr(float(self.snapshot_created_at)),
            "per_rank_files": str(int(self.per_rank_files)),
            "delta_from": str(self.delta_from),
            "delta_bytes": str(self.delta_bytes),
        }
        if self.hf_path:
            fields["hf_path"] = self.hf_path
        if self.no_delta:
            fields["no_delta"] = self.no_delta
        return fields | {"created_at": repr(float(self.created_at))}


TMP_VERSION_PREFIX = ".tmp-v"
"""Where a version is written before it is renamed whole to its directory (``.tmp-v17/``); a
new leader sweeps what starts with it."""


def version_dir_name(version: int) -> str:
    """The directory of ``version`` in the weights directory (``v17``): the one definition
    the publisher writes, deltas find their base by, and a new leader sweeps by."""
    return f"v{version}"


def dir_version(name: str) -> int | None:
    """The version whose directory is called ``name``; None for any other name (``v07``,
    ``v1.bak``, ``.tmp-v3``)."""
    match = _VERSION_DIR.fullmatch(name)
    if match is None or version_dir_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


_SHA256 = re.compile(r"[0-9a-f]{64}")
_VERSION_DIR = re.compile(r"v([0-9]{1,19})")
