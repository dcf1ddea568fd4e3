"""Which blocks of a version's files were already verified, shared by a node's processes.

A vLLM node runs one worker process per tensor-parallel rank. Each reads its own byte ranges
of the version's files, but they overlap (replicated tensors, whole row-parallel tensors, the
header), and workers restart or reload. So that a block is hashed once per node and version
rather than once per worker, the workers share a record on local disk:

``<verified_dir>/v<version>-<manifest_sha256>/`` (the SHA-256 the registry holds, so a record
can only ever apply to the manifest it was made for) holds, per data file, ``<file>.json``:
the file's identity (device, inode, size, mtime, ctime, from ``fstat`` of the descriptor the
blocks were read through) and the indices of the blocks verified (or ``whole`` for a format-1
file whose SHA-256 was checked). A worker reads the record lock-free (records are replaced by
rename, never written in place), hashes the blocks it reads that are not in it, then, under
``flock`` on ``lock``, merges its blocks into the record and replaces it. A record whose
identity differs from the file's (the file was replaced or rewritten) counts for nothing.

Crashes: a worker adds only blocks it has hashed, after hashing them; the lock dies with its
process; a torn or unreadable record is an empty one. Concurrent first readers of a shared
block may both hash it; that costs time, never correctness. Record I/O errors never fail a
load (the record only saves work). The newest ``keep`` record directories are kept.

What a record means: "these bytes were right when a sibling read them through a file of this
identity". It protects against corruption at rest (a torn or truncated write, a file
replaced or rewritten, bit rot before the read), not against someone who can write this
node's record directory; it must be local to the node and private to its user, which is
checked (owned by this user, not writable by others).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from weightcast.contract.errors import ConfigError
from weightcast.contract.untrusted import json_object
from weightcast.runtime.logs import get_logger
from weightcast.store.base import Identity

log = get_logger("verified")

LOCK_NAME = "lock"
KEEP_VERSIONS = 8
_RECORD_DIR = re.compile(r"^v\d+-[0-9a-f]{64}$")
TRASH_PREFIX = ".trash-"


@dataclass(frozen=True)
class RecordKey:
    """One version as the registry describes it: its number and its manifest's SHA-256."""

    version: int
    manifest_sha256: str

    @property
    def dir_name(self) -> str:
        return f"v{self.version}-{self.manifest_sha256}"


@dataclass(frozen=True)
class Verified:
    """What is known to be right in one file: block indices, or all of it (``whole``)."""

    blocks: frozenset[int] = frozenset()
    whole: bool = False

    def __or__(self, other: Verified) -> Verified:
        return Verified(self.blocks | other.blocks, self.whole or other.whole)


class ProcessRecord:
    """The record of one process (no sharing): what this client verified itself."""

    def __init__(self) -> None:
        self._entries: dict[tuple[RecordKey, str], tuple[Identity, Verified]] = {}
        self._lock = threading.Lock()

    def known(self, key: RecordKey, file: str, identity: Identity) -> Verified:
        with self._lock:
            return self._known(key, file, identity)

    def add(self, key: RecordKey, file: str, identity: Identity, verified: Verified) -> None:
        with self._lock:
            self._entries[(key, file)] = (identity, self._known(key, file, identity) | verified)

    def _known(self, key: RecordKey, file: str, identity: Identity) -> Verified:
        found = self._entries.get((key, file))
        return found[1] if found is not None and found[0] == identity else Verified()


class NodeRecord:
    """The record a node's processes share, in ``directory`` on local disk (see above)."""

    def __init__(self, directory: Path | str, keep: int = KEEP_VERSIONS) -> None:
        self.directory = Path(directory)
        self.keep = keep
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = os.lstat(self.directory)
        except OSError as exc:
            raise ConfigError(
                f"verified_dir {self.directory}: cannot create it: {exc.strerror}"
            ) from None
        if not stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"verified_dir {self.directory} is not a directory (or a symlink)")
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise ConfigError(
                f"verified_dir {self.directory} must belong to this user and not be writable "
                "by others (whoever writes it decides what this node skips verifying); "
                f"chmod 700 it or choose another"
            )

    def known(self, key: RecordKey, file: str, identity: Identity) -> Verified:
        return _read_record(self.directory / key.dir_name / f"{file}.json", identity)

    def add(self, key: RecordKey, file: str, identity: Identity, verified: Verified) -> None:
        where = self.directory / key.dir_name
        try:
            created = not where.is_dir()
            where.mkdir(mode=0o700, exist_ok=True)
            with _locked(where / LOCK_NAME):
                path = where / f"{file}.json"
                merged = _read_record(path, identity) | verified
                _write_record(path, identity, merged)
            if created:
                self._prune()
        except OSError as exc:
            log.warning(
                "could not update the verification record; siblings will verify again",
                path=str(where),
                error=str(exc),
            )

    def _prune(self) -> None:
        """Keep the newest ``keep`` version records (by when they were last written)."""
        found = []
        for entry in os.scandir(self.directory):
            if _RECORD_DIR.match(entry.name) and entry.is_dir(follow_symlinks=False):
                found.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.name))
        for _, name in sorted(found, reverse=True)[self.keep :]:
            trash = self.directory / f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(OSError):
                os.rename(self.directory / name, trash)
                shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_record(path: Path, identity: Identity) -> Verified:
    """The record at ``path`` if it is for a file of ``identity``; empty otherwise."""
    try:
        with open(path, "rb") as f:
            raw = json_object(f.read(), str(path), ValueError)
        if raw["identity"] != list(identity):
            return Verified()
        blocks = raw["blocks"]
        if not all(isinstance(b, int) and b >= 0 for b in blocks):
            return Verified()
        return Verified(frozenset(blocks), raw["whole"] is True)
    except (OSError, ValueError, KeyError, TypeError):
        return Verified()


def _write_record(path: Path, identity: Identity, verified: Verified) -> None:
    body = {
        "identity": list(identity),
        "blocks": sorted(verified.blocks),
        "whole": verified.whole,
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
