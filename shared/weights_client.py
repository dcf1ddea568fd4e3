"""The inference-node side of the contract: find, lease, verify and load published versions.

A lease is a member of ``{wc}:weights:leases:<N>`` scored with its expiry; the publisher
never evicts a version with a live lease. The lease is taken by a script that first checks
the version is still live, so a reader either holds a version that stays on disk or learns
at once that it is gone. A background thread renews the lease while it is held.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
import torch
from safetensors.torch import load_file

from shared.keys import Keys
from shared.logs import get_logger
from shared.manifest import MANIFEST_NAME, Manifest, ManifestError, sha256_file, verify_files

log = get_logger("weights")

_LEASE = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return false end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), ARGV[2])
return redis.call('HGETALL', KEYS[3])
"""


class VersionGone(LookupError):
    """The version was evicted before a lease could be taken; ask for the latest again."""


class WeightsError(ValueError):
    """A registered version that must not be loaded (bad path, manifest or file)."""


@dataclass(frozen=True)
class VersionInfo:
    """The registry hash of one version."""

    version: int
    path: Path
    step: int
    layout: str
    tp: int
    dtype: str
    bytes: int
    manifest_sha256: str
    run_id: str
    created_at: float

    @classmethod
    def from_fields(cls, version: int, raw: dict[bytes, bytes]) -> VersionInfo:
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(
            version=version,
            path=Path(fields["path"]),
            step=int(fields["step"]),
            layout=fields["layout"],
            tp=int(fields["tp"]),
            dtype=fields["dtype"],
            bytes=int(fields["bytes"]),
            manifest_sha256=fields["manifest_sha256"],
            run_id=fields["run_id"],
            created_at=float(fields["created_at"]),
        )


class WeightsClient:
    """What an inference node needs: ``latest``, ``wait_for_newer``, ``lease``, ``load``."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        node_id: str,
        weights_root: Path,
        lease_seconds: float = 30.0,
    ) -> None:
        self.redis = client
        self.keys = keys
        self.node_id = node_id
        self.weights_root = Path(weights_root).resolve()
        self.lease_ms = int(lease_seconds * 1000)
        self._lease = client.register_script(_LEASE)

    def latest(self) -> int:
        """The newest published version, 0 when none yet."""
        return int(self.redis.get(self.keys.latest) or 0)

    def wait_for_newer(self, version: int, timeout: float, poll: float = 2.0) -> int | None:
        """Wait until ``latest`` exceeds ``version``; None on timeout.

        Publish events wake it at once; it also re-reads ``latest`` every ``poll`` seconds,
        so a lost event only delays it.
        """
        deadline = time.monotonic() + timeout
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.keys.events)
        try:
            while True:
                latest = self.latest()
                if latest > version:
                    return latest
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                pubsub.get_message(timeout=min(remaining, poll))
        finally:
            pubsub.close()

    @contextmanager
    def lease(self, version: int) -> Iterator[VersionInfo]:
        """Hold ``version`` while the block runs; raises :class:`VersionGone` if evicted."""
        info = self._take_lease(version)
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(version, stop), daemon=True)
        renewer.start()
        try:
            yield info
        finally:
            stop.set()
            renewer.join()
            self.redis.zrem(self.keys.leases(version), self.node_id)

    def open(self, info: VersionInfo) -> Manifest:
        """Check a leased version: path inside the weights root, manifest and file digests."""
        path = info.path.resolve()
        if not path.is_relative_to(self.weights_root):
            raise WeightsError(
                f"version {info.version} is registered at {path}, outside the "
                f"weights root {self.weights_root}; refusing to read it"
            )
        try:
            if sha256_file(path / MANIFEST_NAME) != info.manifest_sha256:
                raise WeightsError(f"{path / MANIFEST_NAME}: sha256 differs from the registry")
            manifest = Manifest.read(path)
            verify_files(path, manifest)
        except (OSError, ManifestError) as exc:
            raise WeightsError(str(exc)) from None
        return manifest

    def load(self, info: VersionInfo, manifest: Manifest) -> dict[str, torch.Tensor]:
        """Every tensor of a verified version, checked against the manifest's shapes."""
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted({t.file for t in manifest.tensors}):
            tensors.update(load_file(str(info.path / name)))
        for entry in manifest.tensors:
            tensor = tensors.get(entry.name)
            if tensor is None or list(tensor.shape) != entry.shape:
                raise WeightsError(
                    f"{entry.file}: tensor {entry.name} is missing or not shaped {entry.shape}"
                )
        return tensors

    def report_loaded(self, version: int) -> None:
        """Record in ``{wc}:nodes`` that this node now serves ``version``."""
        self.redis.hset(
            self.keys.nodes, self.node_id, json.dumps({"version": version, "at": time.time()})
        )

    def _take_lease(self, version: int) -> VersionInfo:
        keys = [self.keys.versions, self.keys.leases(version), self.keys.version(version)]
        raw = self._lease(keys=keys, args=[version, self.node_id, self.lease_ms])
        if not raw:
            raise VersionGone(f"version {version} is no longer live")
        return VersionInfo.from_fields(version, dict(zip(raw[::2], raw[1::2], strict=True)))

    def _renew(self, version: int, stop: threading.Event) -> None:
        while not stop.wait(self.lease_ms / 3000):
            try:
                self._take_lease(version)
            except VersionGone:
                log.error("lease lost: the version expired and was evicted", version=version)
                return
            except redis.RedisError as exc:
                log.warning("lease renewal failed; retrying", version=version, error=str(exc))
