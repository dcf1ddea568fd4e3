"""The inference-node side of the contract: find, lease, verify and load published versions.

A lease is a member of ``{wc}:weights:leases:<N>`` scored with its expiry; the publisher
never evicts a version with a live lease. The lease is taken by a script that first checks
the version is still live, so a reader either holds a version that stays on disk or learns
at once that it is gone. A background thread (an asyncio task in :class:`AsyncWeightsClient`)
renews the lease while it is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from weightcast.contract.errors import VersionGone, WeightsError
from weightcast.contract.keys import Keys
from weightcast.contract.layout import LayoutError, RankSlice, rank_slice
from weightcast.contract.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    TensorEntry,
    sha256_bytes,
    verify_files,
)
from weightcast.contract.snapshots import CONFIG_NAME
from weightcast.runtime.config import default_node_id, load_config
from weightcast.runtime.logs import get_logger

log = get_logger("weights")

FUSED_KINDS = ("qkv", "gate_up")
"""Shard kinds of the fused tensors: laid out for one tp, each rank's block contiguous."""

_LEASE = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return false end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), ARGV[2])
return redis.call('HGETALL', KEYS[3])
"""


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
    def from_fields(cls, version: int, raw: dict[bytes, bytes], root: Path) -> VersionInfo:
        """``path`` is registered relative to the weights directory (older publishers wrote
        absolute paths); it is resolved against ``root``, this node's weights directory."""
        fields = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(
            version=version,
            path=root / fields["path"],
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
    """What an inference node needs: find, wait for, lease, verify and read versions.

    ``weights_root`` is where this node sees the weights directory (the configured
    ``weights_dir`` when not given); a version registered anywhere else is refused.
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str = "wc",
        node_id: str = "",
        weights_root: Path | str | None = None,
        lease_seconds: float = 30.0,
    ) -> None:
        self.redis = redis.Redis.from_url(redis_url)
        self.keys = Keys(namespace)
        self.node_id = node_id or default_node_id()
        root = load_config().common.weights_dir if weights_root is None else weights_root
        self.weights_root = Path(root).resolve()
        self.lease_ms = int(lease_seconds * 1000)
        self._lease = self.redis.register_script(_LEASE)
        self._verified: set[tuple[Path, str]] = set()

    def latest(self) -> int:
        """The newest published version, 0 when none yet."""
        return int(self.redis.get(self.keys.latest) or 0)

    def info(self, version: int) -> VersionInfo:
        """The registry entry of a live version; :class:`VersionGone` if it is not live."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.version(version))
        pipe.zscore(self.keys.versions, version)
        return _live_info(version, *pipe.execute(), self.weights_root)

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
        """Hold ``version`` while the block runs; raises :class:`VersionGone` if evicted.

        A thread renews the lease every third of its time to live; the lease is removed on
        exit, and expires by itself if this process dies.
        """
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

    def open(self, version: int | VersionInfo) -> Manifest:
        """Check a version: path inside the weights root, manifest and every file's digest."""
        info = self._resolve(version)
        manifest = self.manifest(info)
        self._verify(info, manifest, [f.name for f in manifest.files])
        return manifest

    def load(self, version: int | VersionInfo) -> dict[str, torch.Tensor]:
        """Every tensor of a verified version (whole tensors; per-rank files are refused)."""
        info = self._resolve(version)
        manifest = self.manifest(info)
        if manifest.per_rank_files:
            raise WeightsError(
                f"version {info.version} is split into per-rank files; "
                "read it with tensors_for_rank"
            )
        self._verify(info, manifest, [f.name for f in manifest.files])
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted({t.file for t in manifest.tensors}):
            tensors.update(load_file(str(info.path / name)))
        for entry in manifest.tensors:
            _check_shape(entry, tensors.get(entry.name))
        return tensors

    def config(self, version: int | VersionInfo) -> dict[str, Any]:
        """The version's HF ``config.json`` (verified against the manifest)."""
        info = self._resolve(version)
        self._verify(info, self.manifest(info), [CONFIG_NAME])
        return json.loads((info.path / CONFIG_NAME).read_text())

    def tensors_for_rank(
        self,
        version: int | VersionInfo,
        tp_rank: int,
        tp_size: int,
        *,
        whole_unfused: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)``: what vLLM's tensor-parallel rank ``tp_rank`` of ``tp_size``
        holds of each tensor (see ``weightcast.contract.layout.rank_slice``).

        With per-rank files only that rank's file is verified and read; otherwise the rank's
        rows are read out of the shared file (columns for row-parallel tensors). Raises
        :class:`~weightcast.contract.layout.LayoutError` for a ``tp_size`` the version was not
        fused for.
        ``whole_unfused`` yields the tensors that are not fused (``qkv``/``gate_up``) whole,
        for loaders that slice them themselves (vLLM's ``weight_loader``); it needs a
        version without per-rank files.
        """
        info = self._resolve(version)
        manifest = self.manifest(info)
        if not 0 <= tp_rank < tp_size:
            raise LayoutError(f"rank {tp_rank} is outside tp={tp_size}")
        if manifest.per_rank_files:
            if whole_unfused:
                raise WeightsError(
                    f"version {info.version} has per-rank files: whole tensors are not there"
                )
            if manifest.tp != tp_size:
                raise LayoutError(
                    f"version {info.version} has per-rank files for tp={manifest.tp}, "
                    f"not tp={tp_size}"
                )
            entries = [t for t in manifest.tensors if t.rank == tp_rank]
        else:
            entries = list(manifest.tensors)
            for entry in entries:  # refuse a wrong tp before reading anything
                rank_slice(entry.shard, entry.shape, tp_rank, tp_size)
        files = sorted({e.file for e in entries})
        self._verify(info, manifest, files)
        for file in files:
            with safe_open(str(info.path / file), framework="pt") as reader:
                for entry in (e for e in entries if e.file == file):
                    try:
                        tensor_slice = reader.get_slice(entry.name)
                    except Exception:  # safetensors' own error type for a missing name
                        raise WeightsError(f"{file}: holds no tensor {entry.name}") from None
                    if manifest.per_rank_files:
                        tensor = tensor_slice[:]
                        _check_shape(entry, tensor)
                    else:
                        _check_shape(entry, tensor_slice)
                        part = rank_slice(entry.shard, entry.shape, tp_rank, tp_size)
                        fused = entry.shard.get("kind") in FUSED_KINDS
                        tensor = _read_part(
                            tensor_slice, None if whole_unfused and not fused else part
                        )
                    yield entry.name, tensor

    def report_loaded(self, version: int) -> None:
        """Record in ``{wc}:nodes`` that this node now serves ``version``."""
        self.redis.hset(self.keys.nodes, self.node_id, _node_record(version))

    def _resolve(self, version: int | VersionInfo) -> VersionInfo:
        info = version if isinstance(version, VersionInfo) else self.info(version)
        path = info.path.resolve()
        if not path.is_relative_to(self.weights_root):
            raise WeightsError(
                f"version {info.version} is registered at {path}, outside the "
                f"weights root {self.weights_root}; refusing to read it"
            )
        return info

    def manifest(self, version: int | VersionInfo) -> Manifest:
        """The manifest, checked against the digest the registry recorded (files are not)."""
        info = self._resolve(version)
        try:
            data = (info.path / MANIFEST_NAME).read_bytes()
            if sha256_bytes(data) != info.manifest_sha256:
                raise WeightsError(f"{info.path / MANIFEST_NAME}: sha256 differs from the registry")
            return Manifest.from_json(data)
        except (OSError, ManifestError) as exc:
            raise WeightsError(str(exc)) from None

    def _verify(self, info: VersionInfo, manifest: Manifest, names: list[str]) -> None:
        """Size and sha256 of the named files, each checked once per client."""
        wanted = {n for n in names if (info.path, n) not in self._verified}
        listed = {f.name for f in manifest.files}
        if wanted - listed:
            raise WeightsError(
                f"{info.path}: {sorted(wanted - listed)} not listed in the manifest's files"
            )
        try:
            verify_files(
                info.path,
                dataclasses.replace(
                    manifest, files=[f for f in manifest.files if f.name in wanted]
                ),
            )
        except (OSError, ManifestError) as exc:
            raise WeightsError(str(exc)) from None
        self._verified.update((info.path, n) for n in wanted)

    def _take_lease(self, version: int) -> VersionInfo:
        keys = self._lease_keys(version)
        reply = self._lease(keys=keys, args=self._lease_args(version))
        return _leased_info(version, reply, self.weights_root)

    def _lease_keys(self, version: int) -> list[str]:
        return [self.keys.versions, self.keys.leases(version), self.keys.version(version)]

    def _lease_args(self, version: int) -> list[int | str]:
        return [version, self.node_id, self.lease_ms]

    def _renew(self, version: int, stop: threading.Event) -> None:
        while not stop.wait(self.lease_ms / 3000):
            try:
                self._take_lease(version)
            except VersionGone:
                log.error("lease lost: the version expired and was evicted", version=version)
                return
            except redis.RedisError as exc:
                log.warning("lease renewal failed; retrying", version=version, error=str(exc))


class AsyncWeightsClient:
    """:class:`WeightsClient` for asyncio code: waiting and leasing never block the loop.

    Redis is reached through ``redis.asyncio`` and the lease is renewed by a task. Reading and
    verifying files (disk-bound) runs in a worker thread, through a :class:`WeightsClient`
    that is always handed a resolved :class:`VersionInfo`, so it never calls Redis itself.
    """

    def __init__(
        self,
        redis_url: str,
        namespace: str = "wc",
        node_id: str = "",
        weights_root: Path | str | None = None,
        lease_seconds: float = 30.0,
    ) -> None:
        self.files = WeightsClient(redis_url, namespace, node_id, weights_root, lease_seconds)
        self.keys, self.node_id = self.files.keys, self.files.node_id
        self.redis = redis.asyncio.Redis.from_url(redis_url)
        self._lease = self.redis.register_script(_LEASE)

    async def latest(self) -> int:
        """The newest published version, 0 when none yet."""
        return int(await self.redis.get(self.keys.latest) or 0)

    async def info(self, version: int) -> VersionInfo:
        """The registry entry of a live version; :class:`VersionGone` if it is not live."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.version(version))
        pipe.zscore(self.keys.versions, version)
        return _live_info(version, *await pipe.execute(), self.files.weights_root)

    async def wait_for_newer(self, version: int, timeout: float, poll: float = 2.0) -> int | None:
        """Wait until ``latest`` exceeds ``version``; None on timeout (see
        :meth:`WeightsClient.wait_for_newer`). Cancelling the task stops the wait at once."""
        deadline = time.monotonic() + timeout
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.keys.events)
        try:
            while True:
                latest = await self.latest()
                if latest > version:
                    return latest
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                await pubsub.get_message(timeout=min(remaining, poll))
        finally:
            await pubsub.aclose()

    @asynccontextmanager
    async def lease(self, version: int) -> AsyncIterator[VersionInfo]:
        """Hold ``version`` while the block runs; raises :class:`VersionGone` if evicted."""
        info = await self._take_lease(version)
        renewer = asyncio.create_task(self._renew(version))
        try:
            yield info
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            await self.redis.zrem(self.keys.leases(version), self.node_id)

    async def open(self, version: int | VersionInfo) -> Manifest:
        """See :meth:`WeightsClient.open`."""
        return await asyncio.to_thread(self.files.open, await self._info(version))

    async def load(self, version: int | VersionInfo) -> dict[str, torch.Tensor]:
        """See :meth:`WeightsClient.load`."""
        return await asyncio.to_thread(self.files.load, await self._info(version))

    async def config(self, version: int | VersionInfo) -> dict[str, Any]:
        """See :meth:`WeightsClient.config`."""
        return await asyncio.to_thread(self.files.config, await self._info(version))

    async def tensors_for_rank(
        self,
        version: int | VersionInfo,
        tp_rank: int,
        tp_size: int,
        *,
        whole_unfused: bool = False,
    ) -> list[tuple[str, torch.Tensor]]:
        """See :meth:`WeightsClient.tensors_for_rank`; all of the rank's tensors at once."""
        info = await self._info(version)
        return await asyncio.to_thread(
            lambda: list(
                self.files.tensors_for_rank(info, tp_rank, tp_size, whole_unfused=whole_unfused)
            )
        )

    async def report_loaded(self, version: int) -> None:
        """Record in ``{wc}:nodes`` that this node now serves ``version``."""
        await self.redis.hset(self.keys.nodes, self.node_id, _node_record(version))

    async def close(self) -> None:
        await self.redis.aclose()
        self.files.redis.close()

    async def _info(self, version: int | VersionInfo) -> VersionInfo:
        return version if isinstance(version, VersionInfo) else await self.info(version)

    async def _take_lease(self, version: int) -> VersionInfo:
        reply = await self._lease(
            keys=self.files._lease_keys(version), args=self.files._lease_args(version)
        )
        return _leased_info(version, reply, self.files.weights_root)

    async def _renew(self, version: int) -> None:
        while True:
            await asyncio.sleep(self.files.lease_ms / 3000)
            try:
                await self._take_lease(version)
            except VersionGone:
                log.error("lease lost: the version expired and was evicted", version=version)
                return
            except redis.RedisError as exc:
                log.warning("lease renewal failed; retrying", version=version, error=str(exc))


def _node_record(version: int) -> str:
    """A node's entry in ``{wc}:nodes``: the version it serves, since when."""
    return json.dumps({"version": version, "at": time.time()})


def _live_info(
    version: int, raw: dict[bytes, bytes], score: float | None, root: Path
) -> VersionInfo:
    """A version's registry hash, if the version is still in the live set."""
    if not raw or score is None:
        raise VersionGone(f"version {version} is not live")
    return VersionInfo.from_fields(version, raw, root)


def _leased_info(version: int, reply: list[bytes] | None, root: Path) -> VersionInfo:
    """The lease script's reply: the version's hash as a flat list, or nothing if evicted."""
    if not reply:
        raise VersionGone(f"version {version} is no longer live")
    fields = dict(zip(reply[::2], reply[1::2], strict=True))
    return VersionInfo.from_fields(version, fields, root)


def _check_shape(entry: TensorEntry, tensor: Any) -> None:
    shape = (
        None
        if tensor is None
        else list(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)
    )
    if shape != entry.shape:
        raise WeightsError(
            f"{entry.file}: tensor {entry.name} is missing or not shaped {entry.shape}"
        )


def _read_part(tensor_slice: Any, part: RankSlice | None) -> torch.Tensor:
    """Read only the rank's rows (or columns) of a safetensors slice."""
    if part is None:
        return tensor_slice[:]
    if part.dim == 0:
        return tensor_slice[part.start : part.stop]
    return tensor_slice[:, part.start : part.stop]
