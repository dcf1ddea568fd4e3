"""The repository's root, a size-capped tmpfs, a watch on which files a process opens, and
small version directories written by hand."""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

VERSION_FILES = {
    "model.vllm-fused": b"w" * 10,
    "config.json": b"{}",
    "manifest.json": b'{"m": 1}',
    "delta-from-v1.xor-zstd": b"d",
}
"""A version directory's files in name and size only (a store moves them; nothing parses them)."""


def version_dir(root: Path, name: str, files: dict[str, bytes] = VERSION_FILES) -> Path:
    """``root/name`` holding ``files``."""
    path = root / name
    path.mkdir(parents=True)
    for file, data in files.items():
        (path / file).write_bytes(data)
    return path


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``16k``, ``2m``) mounted at ``path`` for a test: a small
    filesystem that fills up. Needs root (or CAP_SYS_ADMIN)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        raise AssertionError(f"this test mounts a tmpfs (run it as root): {mounted.stderr}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


class OpenWatch:
    """The kernel's word (inotify ``IN_OPEN`` / ``IN_ACCESS``) on whether any process opened
    or read a file directly in ``directory`` while the watch was on."""

    IN_ACCESS, IN_OPEN = 0x1, 0x20

    def __init__(self, directory: Path) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        mask = self.IN_ACCESS | self.IN_OPEN
        assert self._libc.inotify_add_watch(self.fd, str(directory).encode(), mask) >= 0

    def touched(self) -> list[str]:
        """Names opened or read since the watch began (or since the last call)."""
        names = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return names
            offset = 0
            while offset < len(data):
                _wd, _mask, _cookie, length = struct.unpack_from("iIII", data, offset)
                names.append(data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode())
                offset += 16 + length

    def close(self) -> None:
        os.close(self.fd)
