"""Directories a process writes, proved writable before it starts any work."""

from __future__ import annotations

import uuid
from pathlib import Path

from weightcast.contract.errors import ConfigError


def check_writable_dir(path: Path, name: str) -> None:
    """Create ``path`` if needed and prove it writable (a real write: root ignores modes);
    ``name`` is the setting that gave it, for the error."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name} {path} is not a directory")
    probe = path / f".weightcast-probe-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{name} {path} is not writable: {exc.strerror or exc}") from None
