"""The inference-node side of the contract: find, lease, verify and read published versions.

:class:`WeightsClient` is the one implementation: the Redis side (latest, waiting, leases,
reports) here, the file side in :class:`~weightcast.client.reader.VersionReader` (confined,
verified, per-rank reads). :class:`AsyncWeightsClient` runs the same client's calls in worker
threads, so asyncio servers get the same behaviour without blocking their loop.

A lease (:mod:`weightcast.contract.leases`, the protocol the publisher's eviction keeps) is
taken by a script that first checks the version is still live, so a reader either holds a
version that stays on disk or learns at once that it is gone. A thread renews the lease
while it is held.

A client that keeps its base and is asked for a version whose delta is not from the one it
holds looks for a chain (:mod:`weightcast.client.chains`): the versions between, each one's
delta from the one before, live or delta-only (``{wc}:weights:deltas``). It leases every link
while it reads them (:class:`ChainLease`) and hands their entries to the reader, which
applies the deltas when together they are smaller than the version.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis
import torch

from weightcast.client.chains import DEFAULT_MAX_DELTA_CHAIN, chain_links
from weightcast.client.identity import default_node_id
from weightcast.client.reader import VersionReader
from weightcast.client.versions import live_info
from weightcast.contract.errors import VersionGone, WeightsError
from weightcast.contract.keys import Keys
from weightcast.contract.leases import Leases
from weightcast.contract.manifest import Manifest
from weightcast.contract.nodes import NodeReport
from weightcast.contract.version_info import VersionInfo
from weightcast.runtime.logs import get_logger
from weightcast.runtime.redis_client import redis_client
from weightcast.runtime.retry import REDIS_DOWN
from weightcast.runtime.stop import Stop

log = get_logger("weights")

STOP_CHECK_S = 0.25
"""How often a wait that can be stopped from another thread looks at its stop event."""


class WeightsClient:
    """What an inference node needs: find, wait for, lease, verify and read versions.

    ``weights_root`` is where this node sees the weights directory; registered paths are
    resolved against it and nothing outside it is opened. ``verified_dir`` is a node-local
    directory that the node's reader processes (vLLM workers) share so that each block is
    verified once per node and version (see :mod:`weightcast.client.verified`); None keeps
    that record in this process. ``keep_base``: keep the verified blocks of the last version
    read, which the returned tensors are views of, and read the next version of the same part
    by its delta from them when it has one (:mod:`weightcast.client.delta_reads`): the
    tensors returned before are then updated in place (clone one to keep a version). Such a
    client reads one version at a time (the base is replaced by each read); several versions
    behind, it applies the deltas of the versions between, at most ``max_delta_chain`` in a
    row, when together they are smaller than the version (:mod:`weightcast.client.chains`).
    """

    def __init__(
        self,
        redis_url: str,
        weights_root: Path | str,
        *,
        namespace: str = "wc",
        node_id: str = "",
        lease_seconds: float = 30.0,
        verified_dir: Path | str | None = None,
        keep_base: bool = False,
        store_retry_seconds: float = 60.0,
        max_delta_chain: int = DEFAULT_MAX_DELTA_CHAIN,
    ) -> None:
        self.redis = redis_client(redis_url)
        self.keys = Keys(namespace)
        self.node_id = node_id or default_node_id()
        self.reader = VersionReader(
            weights_root, verified_dir, keep_base, store_retry_seconds, max_delta_chain
        )
        self.lease_ms = int(lease_seconds * 1000)
        self.leases = Leases(self.redis, self.keys)

    def latest(self) -> int:
        """The newest published version, 0 when none yet."""
        return int(self.redis.get(self.keys.latest) or 0)

    def info(self, version: int) -> VersionInfo:
        """The registry entry of a live version; :class:`VersionGone` if it is not live."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.version(version))
        pipe.zscore(self.keys.versions, version)
        return live_info(version, *pipe.execute())

    def wait_for_newer(
        self,
        version: int,
        timeout: float,
        poll: float = 2.0,
        stop: Stop | None = None,
    ) -> int | None:
        """Wait until ``latest`` exceeds ``version``; None on timeout (or once ``stop`` is set).

        Publish events wake it at once; it also re-reads ``latest`` every ``poll`` seconds,
        so a lost event only delays it.
        """
        deadline = time.monotonic() + timeout
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self.keys.events)
            read_at = 0.0
            while stop is None or not stop.is_set():
                now = time.monotonic()
                if now >= read_at:
                    latest = self.latest()
                    if latest > version:
                        return latest
                    read_at = now + poll
                if now >= deadline:
                    return None
                wait = min(deadline, read_at) - now
                if pubsub.get_message(timeout=min(wait, STOP_CHECK_S) if stop else wait):
                    read_at = 0.0  # an event: read latest now
            return None
        finally:
            pubsub.close()

    def lease(self, version: int) -> Lease:
        """Hold ``version``: ``with client.lease(v) as info:``, or keep the :class:`Lease` and
        :meth:`Lease.release` it; raises :class:`VersionGone` if evicted.

        A thread renews the lease every third of its time to live; the lease is removed on
        release, and expires by itself if this process dies.
        """
        return Lease(self, version)

    def _take_lease(self, version: int) -> VersionInfo:
        """Add or renew this node's lease on ``version``; the version's registry entry."""
        return self.leases.take(version, self.node_id, self.lease_ms)

    def manifest(self, version: int | VersionInfo) -> Manifest:
        """The manifest, checked against the digest the registry recorded."""
        return self.reader.manifest(self._info(version))

    def verify(self, version: int | VersionInfo) -> Manifest:
        """Check all a node reads of a version: manifest, config and every tensor file."""
        return self.reader.verify(self._info(version))

    def load(self, version: int | VersionInfo) -> dict[str, torch.Tensor]:
        """Every tensor of a verified version, whole (per-rank files are refused)."""
        info = self._info(version)
        return self._chained(info, lambda links: self.reader.load(info, links))

    def config(self, version: int | VersionInfo) -> dict[str, Any]:
        """The version's HF ``config.json`` (verified against the manifest)."""
        return self.reader.config(self._info(version))

    def rank_tensors(
        self, version: int | VersionInfo, tp_rank: int, tp_size: int, ep: int = 1
    ) -> dict[str, torch.Tensor]:
        """What vLLM's tensor-parallel rank ``tp_rank`` of ``tp_size`` (expert parallelism
        ``ep``) holds of each tensor, reading and verifying only the blocks that hold it (see
        :meth:`weightcast.client.reader.VersionReader.rank_tensors`)."""
        info = self._info(version)
        return self._chained(
            info, lambda links: self.reader.rank_tensors(info, tp_rank, tp_size, ep, links)
        )

    def report_loaded(
        self, version: int, error: str = "", via: str = "", read_bytes: int = 0
    ) -> None:
        """Record in ``{wc}:nodes`` that this node now serves ``version`` (and why the last
        version offered was not loaded, if it was not), and how it got it (``via`` delta or
        full, reading ``read_bytes``)."""
        report = NodeReport(version, time.time(), error, via, read_bytes)
        self.redis.hset(self.keys.nodes, self.node_id, report.encode())

    def close(self) -> None:
        self.redis.close()
        self.reader.close()

    def _info(self, version: int | VersionInfo) -> VersionInfo:
        return version if isinstance(version, VersionInfo) else self.info(version)

    def _chained(
        self, info: VersionInfo, read: Callable[[Sequence[VersionInfo]], dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """``read(links)``: with the leased links of a chain from the version held to
        ``info``'s when there is one that pays, else with none (the reader then reads by
        delta or in full, and says why no chain)."""
        # The base's number, not the base: a full read lets go of it (one version held, not two).
        held = self.reader.base.version if self.reader.keep_base and self.reader.base else None
        if held is None or info.delta_from in (0, held) or info.version <= held:
            return read(())
        links, why = chain_links(info, held, self._link_entry, self.reader.max_delta_chain)
        if not why:
            try:
                with ChainLease(self, [link.version for link in links]) as leased:
                    return read(leased)
            except VersionGone as exc:
                why = f"a link was evicted ({exc})"
        tensors = read(())
        if why and self.reader.stats.via == "full":
            self.reader.stats.reason += f"; no chain of deltas: {why}"
        return tensors

    def _link_entry(self, version: int) -> VersionInfo | None:
        """The registry entry of ``version`` (live or delta-only), None when it has none."""
        fields = self.redis.hgetall(self.keys.version(version))
        try:
            return VersionInfo.from_fields(version, fields) if fields else None
        except WeightsError:  # a damaged link: the chain is refused, not the version
            return None


class ChainLease:
    """Leases on the links of a delta chain (live or delta-only versions), taken in order
    and renewed by one thread until :meth:`release`; :class:`VersionGone` (the leases taken
    released) when a link is gone. Entering gives the links' entries as the leases returned
    them."""

    def __init__(self, client: WeightsClient, versions: Sequence[int]) -> None:
        self.client = client
        self.infos: list[VersionInfo] = []
        try:
            for version in versions:
                self.infos.append(self._take(version))
        except BaseException:
            self._release()
            raise
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="weightcast-chain", daemon=True)
        self._renewer.start()

    def __enter__(self) -> list[VersionInfo]:
        return self.infos

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        self._stop.set()
        self._renewer.join()
        self._release()

    def _take(self, version: int) -> VersionInfo:
        client = self.client
        return client.leases.take_link(version, client.node_id, client.lease_ms)

    def _release(self) -> None:
        for info in self.infos:
            try:
                self.client.leases.release(info.version, self.client.node_id)
            except REDIS_DOWN as exc:
                log.warning(
                    "could not remove the lease; it expires by itself",
                    version=info.version,
                    error=str(exc),
                )

    def _renew(self) -> None:
        while not self._stop.wait(self.client.lease_ms / 3000):
            for info in self.infos:
                try:
                    self._take(info.version)
                except (redis.RedisError, WeightsError) as exc:
                    log.warning("chain lease renewal failed", version=info.version, error=str(exc))


class Lease:
    """A lease held on one version; a thread renews it until :meth:`release` (or the end of
    the ``with`` block)."""

    def __init__(self, client: WeightsClient, version: int) -> None:
        self.client = client
        self.info = info = client._take_lease(version)
        self._stop = threading.Event()
        self._renewer = threading.Thread(
            target=self._renew, name=f"weightcast-lease-v{info.version}", daemon=True
        )
        self._renewer.start()

    def __enter__(self) -> VersionInfo:
        return self.info

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Stop renewing and remove the lease (if Redis is away it expires by itself)."""
        self._stop.set()
        self._renewer.join()
        try:
            self.client.leases.release(self.info.version, self.client.node_id)
        except REDIS_DOWN as exc:
            log.warning(
                "could not remove the lease; it expires by itself",
                version=self.info.version,
                error=str(exc),
            )

    def _renew(self) -> None:
        while not self._stop.wait(self.client.lease_ms / 3000):
            try:
                self.client._take_lease(self.info.version)
            except VersionGone:
                log.error(
                    "lease lost: it expired and the version was evicted", version=self.info.version
                )
                return
            except (redis.RedisError, WeightsError) as exc:
                log.warning(
                    "lease renewal failed; retrying", version=self.info.version, error=str(exc)
                )


class AsyncWeightsClient:
    """:class:`WeightsClient` for asyncio code (it takes the same arguments): the same
    client, each call in a worker thread.

    Waiting, leasing, reading and verifying never block the event loop; cancelling a
    :meth:`wait_for_newer` returns at once (its thread stops within ``STOP_CHECK_S``).
    """

    def __init__(self, redis_url: str, weights_root: Path | str, **options: Any) -> None:
        self.client = WeightsClient(redis_url, weights_root, **options)
        self.keys, self.node_id = self.client.keys, self.client.node_id

    async def latest(self) -> int:
        return await asyncio.to_thread(self.client.latest)

    async def info(self, version: int) -> VersionInfo:
        return await asyncio.to_thread(self.client.info, version)

    async def wait_for_newer(self, version: int, timeout: float, poll: float = 2.0) -> int | None:
        stop = threading.Event()
        try:
            return await asyncio.to_thread(self.client.wait_for_newer, version, timeout, poll, stop)
        finally:
            stop.set()

    @asynccontextmanager
    async def lease(self, version: int) -> AsyncIterator[VersionInfo]:
        held = await asyncio.to_thread(self.client.lease, version)
        try:
            yield held.info
        finally:
            await asyncio.to_thread(held.release)

    async def manifest(self, version: int | VersionInfo) -> Manifest:
        return await asyncio.to_thread(self.client.manifest, version)

    async def verify(self, version: int | VersionInfo) -> Manifest:
        return await asyncio.to_thread(self.client.verify, version)

    async def load(self, version: int | VersionInfo) -> dict[str, torch.Tensor]:
        return await asyncio.to_thread(self.client.load, version)

    async def config(self, version: int | VersionInfo) -> dict[str, Any]:
        return await asyncio.to_thread(self.client.config, version)

    async def rank_tensors(
        self, version: int | VersionInfo, tp_rank: int, tp_size: int, ep: int = 1
    ) -> dict[str, torch.Tensor]:
        return await asyncio.to_thread(self.client.rank_tensors, version, tp_rank, tp_size, ep)

    async def report_loaded(
        self, version: int, error: str = "", via: str = "", read_bytes: int = 0
    ) -> None:
        await asyncio.to_thread(self.client.report_loaded, version, error, via, read_bytes)

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)
