"""One publish, from a snapshot to the registry: write in the store, finish there, register.

:meth:`Publishing.publish` begins the version in the publisher's store, has
:func:`~weightcast_publisher.converter.write_version` write it in the directory the store
hands out (snapshot source -> layout plan -> writer, the weights files sent to a bucket as
they are written), finishes it in the store (renamed to ``v<N>/`` in the weights directory,
then the rest of its files sent, ``manifest.json`` last), then registers it
(:meth:`Publishing.register`). The registry records ``path`` relative to the weights
directory (``v17``, ``v17/hf``), so every node resolves it against its own mount.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import redis

from weightcast.contract.errors import ConfigError, LayoutError, WeightcastError
from weightcast.contract.events import Published as PublishedEvent
from weightcast.contract.manifest import ManifestError, new_hasher
from weightcast.contract.version_info import VersionInfo, version_dir_name
from weightcast.runtime.durable import remove_dir
from weightcast.runtime.logs import get_logger
from weightcast.runtime.retry import REDIS_DOWN
from weightcast.store.base import LocalVersionWrite
from weightcast_publisher.context import PublisherContext
from weightcast_publisher.converter import ConvertedVersion, ConvertOptions, write_version
from weightcast_publisher.delta_writer import auto_wait_share, warm_base
from weightcast_publisher.registry import ALREADY_HANDLED, REGISTERED
from weightcast_publisher.settings import PublisherConfig
from weightcast_publisher.snapshot_scan import Snapshot

log = get_logger("publisher")


def convert_options(cfg: PublisherConfig) -> ConvertOptions:
    """The converter's options from the publisher's settings (a digest it does not know is a
    ConfigError); the delta kernels compiled now when deltas are on."""
    try:
        new_hasher(cfg.digest)
    except ManifestError as exc:
        raise ConfigError(f"publisher.digest={cfg.digest}: {exc}") from None
    options = ConvertOptions(
        tp=cfg.tp,
        layout=cfg.layout,
        per_rank_files=cfg.per_rank_files,
        reader=cfg.reader,
        digest=cfg.digest,
        delta=cfg.delta,
        expert_parallel=cfg.expert_parallel,
        delta_max_ratio=cfg.delta_max_ratio,
        delta_behind=cfg.delta_behind,
        quantize=cfg.quantize,
    )
    if cfg.delta:  # numba only where deltas are on (some 60 MB and 0.2 s to import)
        from weightcast.contract.sparse_xor import compile_kernels

        compile_kernels()
    return options


class Publishing:
    """Publishes a snapshot as the next version: written and finished in the publisher's
    store, then registered."""

    def __init__(self, ctx: PublisherContext, options: ConvertOptions) -> None:
        self.ctx = ctx
        self.options = options
        self.warming: threading.Thread | None = None
        """The read of the last version back into the page cache (the next delta's base)."""

    def publish(self, snapshot: Snapshot) -> None:
        """Write ``snapshot`` as a new version in the store and register it. A snapshot that
        cannot be published raises :class:`~weightcast_publisher.snapshot_scan.CorruptSnapshot`
        (the caller quarantines it)."""
        ctx = self.ctx
        start = time.perf_counter()
        version = ctx.registry.allocate_version()
        write = ctx.store.begin_version(version_dir_name(version))
        try:
            published = self.convert(snapshot, version, write)
        except LayoutError as exc:
            placement = " with publisher.expert_parallel" if ctx.cfg.expert_parallel else ""
            raise ConfigError(
                f"publisher.tp={ctx.cfg.tp}{placement} cannot serve the model of "
                f"{snapshot.path}: {exc}"
            ) from None
        self.finish(version, write, published)
        outcome, lag = self.register(version, snapshot, published)
        if outcome != REGISTERED:
            why = "already handled" if outcome == ALREADY_HANDLED else "lost the publisher lock"
            log.warning("version not registered; removing it", version=version, reason=why)
            ctx.store.remove_version(version_dir_name(version))
            return
        seconds = time.perf_counter() - start
        manifest = published.manifest
        if self.options.delta:  # the next version's delta reads this one from memory
            weights = sorted({t.file for t in manifest.tensors})
            size = sum(f.bytes for f in manifest.files if f.name in weights)
            self.warming = warm_base(published.path, weights, size, ctx.stopping)
        ctx.metrics.publish_seconds.observe(seconds)
        ctx.metrics.lag_seconds.observe(lag)
        ctx.metrics.bytes.inc(manifest.total_bytes)
        ctx.metrics.versions.labels(published.reader).inc()
        ctx.metrics.latest.set(version)
        if published.no_delta:
            ctx.metrics.deltas_dropped.labels(published.no_delta_kind).inc()
        log.info(
            "published version",
            version=version,
            step=snapshot.step,
            bytes=manifest.total_bytes,
            seconds=seconds,
            lag_s=lag,
            reader=published.reader,
            linked=published.linked,
            delta_bytes=manifest.delta.bytes if manifest.delta else 0,
            no_delta=published.no_delta,
        )

    def convert(
        self, snapshot: Snapshot, version: int, write: LocalVersionWrite
    ) -> ConvertedVersion:
        """Write the version where ``write`` says (its weights files sent to a bucket as they
        are written); whatever fails leaves nothing of it (``write`` is aborted)."""
        options = self.options
        if options.delta:
            share = auto_wait_share(self.live_nodes())
            options = dataclasses.replace(options, delta_wait_share=share)
        return write_version(snapshot, write, version, options)

    def live_nodes(self) -> int:
        """The nodes that report to the registry (stale ones are pruned by housekeeping);
        0 when Redis cannot say now (the publish goes on: this only sizes a budget)."""
        try:
            return int(self.ctx.redis.hlen(self.ctx.keys.nodes))
        except redis.RedisError as exc:
            log.warning("live nodes unknown", reason=str(exc))
            return 0

    def finish(self, version: int, write: LocalVersionWrite, published: ConvertedVersion) -> None:
        """Finish the written version in the store (``write.finish``). On failure the version
        is removed, from the store and from here, and the snapshot is published again at the
        next round."""
        start = time.perf_counter()
        try:
            sent = write.finish(write.directory)
        except BaseException:
            with contextlib.suppress(WeightcastError):
                self.ctx.store.remove_version(version_dir_name(version))
            remove_dir(published.path)
            raise
        if sent:
            seconds = time.perf_counter() - start
            self.ctx.metrics.upload_seconds.observe(seconds)
            log.info(
                "uploaded version", version=version, store=self.ctx.store.label, seconds=seconds
            )

    def register(
        self, version: int, snapshot: Snapshot, published: ConvertedVersion
    ) -> tuple[int, float]:
        """Register the whole version directory, riding out a Redis outage; (outcome, lag).

        ``path`` (and ``hf_path``) are relative to the weights directory.
        """
        ctx = self.ctx
        manifest, snapshot_info = published.manifest, snapshot.info
        path = version_dir_name(version)
        entry = VersionInfo(
            version=version,
            path=path,
            step=snapshot.step,
            layout=manifest.layout,
            tp=manifest.tp,
            dtype=manifest.dtype,
            bytes=manifest.total_bytes,
            manifest_sha256=published.manifest_sha256,
            run_id=snapshot_info.run_id,
            created_at=0.0,  # the time of each try, below
            delta_from=manifest.delta.base_version if manifest.delta else 0,
            delta_bytes=manifest.delta.bytes if manifest.delta else 0,
            snapshot_id=snapshot_info.snapshot_id,
            snapshot_created_at=float(snapshot_info.created_at),
            per_rank_files=manifest.per_rank_files,
            hf_path=f"{path}/{manifest.hf_dir}" if manifest.hf_dir else "",
            no_delta=published.no_delta,
        )
        while True:
            registered_at = time.time()
            lag = registered_at - snapshot_info.created_at
            event = PublishedEvent(
                version,
                snapshot.step,
                round(lag, 4),
                path,
                snapshot_info.snapshot_id,
                delta_bytes=entry.delta_bytes,
                no_delta=entry.no_delta,
            )
            try:
                if not ctx.lock.held:
                    ctx.lock.try_acquire()  # taken back if no one else took it meanwhile
                outcome = ctx.registry.register(
                    dataclasses.replace(entry, created_at=registered_at),
                    event,
                    ctx.lock.holder,
                )
                return outcome, lag
            except REDIS_DOWN as exc:
                if ctx.stopping.is_set() or ctx.cfg.once:
                    raise  # the unregistered directory is removed at the next start
                ctx.metrics.errors.labels("redis").inc()
                ctx.stopping.wait(ctx.outage.failed(exc, f"registering version {version}"))
