"""The publisher's loop: lead, scan, publish the newest complete snapshot, evict, prune, wait.

Only the holder of the namespace's publisher lock works; a second publisher waits as a
standby and takes over within the lock's TTL when the leader dies. A scan runs at start,
after every watchdog hint and at least every ``rescan_seconds``. When several snapshots are
pending only the newest is published; the older ones are recorded as skipped. Published,
skipped and quarantined snapshots are removed from the checkpoint directory except the
newest two. A Redis outage is ridden out for ``redis_retry_seconds``
(:class:`~weightcast.runtime.retry.Outage`), a failing disk (full, read-only) is retried
without end, both with capped exponential back-off: nothing is registered meanwhile, temp
files are removed, ``/healthz`` says 503.

One publish, from the daemon to the registry: :meth:`Publisher.publish` calls
:func:`~weightcast_publisher.converter.convert` (snapshot source -> layout plan -> writer ->
``v<N>/``), then :meth:`Publisher.register`. The registry records ``path`` relative to the
weights directory (``v17``, ``v17/hf``), so every node resolves it against its own mount.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from weightcast.contract.durable import TRASH_PREFIX, remove_dir, sweep
from weightcast.contract.errors import (
    ConfigError,
    LayoutError,
    StoreFull,
    StoreUnavailable,
    WeightcastError,
    WeightsError,
)
from weightcast.contract.events import Published as PublishedEvent
from weightcast.contract.keys import SNAPSHOT_QUARANTINED, SNAPSHOT_SKIPPED, Keys
from weightcast.contract.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    ManifestError,
    new_hasher,
    sha256_bytes,
    sha256_file,
)
from weightcast.contract.quarantine import QuarantineRecord
from weightcast.contract.snapshot_format import snapshot_step
from weightcast.contract.version_info import VersionInfo, dir_version, version_dir_name
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger
from weightcast.runtime.observability import Health, serve
from weightcast.runtime.redis_client import redis_client
from weightcast.runtime.retry import REDIS_DOWN, Backoff, Outage
from weightcast.runtime.stop import StopRequest
from weightcast.store.base import RemoteStore
from weightcast.store.factory import open_store
from weightcast_publisher.converter import (
    TMP_VERSION_PREFIX,
    ConvertedVersion,
    ConvertOptions,
    convert,
)
from weightcast_publisher.delta_writer import auto_wait_share, warm_base
from weightcast_publisher.eviction import (
    Evictor,
    delta_only_names,
    remove_version_files,
    trim_version_files,
)
from weightcast_publisher.leader import LeaderLock
from weightcast_publisher.metrics import PublisherMetrics
from weightcast_publisher.registry import ALREADY_HANDLED, REGISTERED, Registry
from weightcast_publisher.retention import (
    prune_nodes,
    prune_quarantine_records,
    prune_snapshot_records,
)
from weightcast_publisher.snapshot_scan import (
    CorruptSnapshot,
    DirId,
    Snapshot,
    complete_snapshots,
    discard,
    set_aside,
)
from weightcast_publisher.watcher import SnapshotWatcher

log = get_logger("publisher")

KEEP_SNAPSHOTS = 2
QUARANTINE_DIR = "quarantine"
REASON_FILE = "REASON.txt"


class NotLeader(WeightcastError):
    """``--once`` found another publisher holding the lock."""


class Publisher:
    def __init__(self, config: Config) -> None:
        cfg = config.publisher
        self.cfg = cfg
        try:
            new_hasher(cfg.digest)
        except ManifestError as exc:
            raise ConfigError(f"publisher.digest={cfg.digest}: {exc}") from None
        self.options = ConvertOptions(
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
        self.checkpoint_dir = Path(config.common.checkpoint_dir)
        self.weights_dir = Path(config.common.weights_dir)
        self.remote: RemoteStore | None = None
        """The bucket each version is uploaded to once it is complete here (the next delta's
        base stays here); None: nodes read the weights directory itself."""
        if config.common.weights_url:
            store = open_store(config.common.weights_location(), config.common.store_retry_seconds)
            assert isinstance(store, RemoteStore)
            self.remote = store
        self.keys = Keys(config.common.namespace)
        self.redis = redis_client(config.common.redis_url)
        self.registry = Registry(self.redis, self.keys)
        self.evictor = Evictor(
            self.redis,
            self.keys,
            self.remove_version,
            self.trim_version,
            cfg.keep,
            cfg.delta_window,
        )
        self.lock = LeaderLock(self.redis, self.keys, cfg.leader_ttl_seconds)
        self.metrics = PublisherMetrics()
        self.stopping = StopRequest()
        """Set by SIGTERM / SIGINT (a flag: see :mod:`weightcast.runtime.stop`) or :meth:`stop`."""
        self.warming: threading.Thread | None = None
        """The read of the last version back into the page cache (the next delta's base)."""
        self.outage = Outage(budget=config.common.redis_retry_seconds, cap=cfg.retry_max_seconds)
        self.disk = Backoff(cap=cfg.retry_max_seconds)
        """The back-off of a failing disk (full, read-only) or store (down, full), retried
        without end."""
        self.last_error = ""
        self.last_tick = time.monotonic()
        self.announced_standby = False
        self.live_versions_stored = False
        """Whether the store was checked for the live versions since the lock was taken."""
        self.watcher: SnapshotWatcher | None = None
        self._health_redis = redis_client(config.common.redis_url, timeout=1)

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT, or with ``--once`` publish what is there and return."""
        with self._serving() as watcher:
            if self.cfg.once:
                self.publish_once(watcher)
            else:
                while not self.stopping.is_set():
                    delay = self.round()
                    self.last_tick = time.monotonic()
                    watcher.wait(delay, self.stopping)

    def round(self) -> float:
        """One round of the loop: lead or stand by, then scan; the wait before the next.

        A Redis outage or a disk error ends the round early; the wait is then the back-off.
        """
        try:
            if not self.ensure_leader():
                return min(self.cfg.rescan_seconds, self.cfg.leader_ttl_seconds / 3)
            self.scan_once()
        except REDIS_DOWN as exc:
            self.metrics.errors.labels("redis").inc()
            self.last_error = f"redis: {exc}"
            return self.outage.failed(exc, "publishing")
        except (StoreUnavailable, StoreFull) as exc:
            return self._store_failed(exc)
        except OSError as exc:
            return self._disk_failed(exc)
        self._recovered()
        return self.cfg.rescan_seconds

    def publish_once(self, watcher: SnapshotWatcher) -> None:
        """``--once``: take the lock (waiting at most two TTLs), publish what is complete."""
        deadline = time.monotonic() + 2 * self.cfg.leader_ttl_seconds
        while not self.ensure_leader():
            if time.monotonic() > deadline:
                raise NotLeader(
                    f"another publisher ({self.lock.current_holder()}) holds the "
                    "lock; stop it or wait for its lock to expire"
                )
            watcher.wait(self.cfg.leader_ttl_seconds / 3)
        self.scan_once()

    @contextlib.contextmanager
    def _serving(self) -> Iterator[SnapshotWatcher]:
        """Directories, signal handlers, /metrics and the watcher, for one run."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.remote is not None:
                self.remote.check()  # a missing bucket or a refused credential: exit 2 now
        except StoreUnavailable as exc:
            log.warning("object store unavailable at start; publishing retries it", error=str(exc))
        watcher = self.watcher = SnapshotWatcher(self.checkpoint_dir, poll=self.cfg.poll)
        if threading.current_thread() is threading.main_thread():
            self.stopping.install()
        server = serve(self.cfg.metrics_port, self.health, self.metrics.render)
        watcher.start()
        log.info(
            "publisher started",
            checkpoint_dir=str(self.checkpoint_dir),
            weights_dir=str(self.weights_dir),
            store=self.remote.label if self.remote else None,
            tp=self.cfg.tp,
            layout=self.cfg.layout,
            per_rank_files=self.cfg.per_rank_files,
            expert_parallel=self.cfg.expert_parallel,
            quantize=self.cfg.quantize,
            digest=self.cfg.digest,
            keep=self.cfg.keep,
            holder=self.lock.holder,
            observer=type(watcher.observer).__name__,
        )
        try:
            yield watcher
        finally:
            self.watcher = None
            watcher.stop()
            self.lock.release()
            if server is not None:
                server.close()
            log.info("publisher stopped")

    def ensure_leader(self) -> bool:
        """Hold the publisher lock; on taking it, clean what a crashed leader left."""
        if self.lock.held:
            return True
        if self.lock.try_acquire():
            log.info("became the active publisher", holder=self.lock.holder)
            self.announced_standby = False
            self.metrics.leader.set(1)
            self.clean_weights_dir()
            self.lock.start_renewing()
            self.live_versions_stored = False
            return True
        if not self.announced_standby:
            log.info("standing by: another publisher is active", holder=self.lock.current_holder())
            self.announced_standby = True
        self.metrics.leader.set(0)
        return False

    def scan_once(self) -> None:
        """One pass: publish the newest pending snapshot, then evict and prune."""
        if not self.lock.held and not self.lock.try_acquire():
            log.info("not the active publisher; scan skipped")
            return
        if not self.live_versions_stored:
            self.upload_live_versions()
            self.live_versions_stored = True
        pending = self.pending_snapshots()
        if pending:
            self.publish(pending[-1])
        self.evict()
        self.prune_snapshots()
        self.prune_quarantine()
        self.prune_records()

    def pending_snapshots(self) -> list[Snapshot]:
        """Complete snapshots not yet handled, oldest first; the broken ones quarantined and
        all but the newest recorded as skipped."""
        snapshots, broken = complete_snapshots(self.checkpoint_dir)
        for bad in broken:
            self.quarantine(bad.path, None, bad.reason, snapshot_step(bad.path.name), bad.dir_id)
        handled = self.registry.handled()
        pending = [s for s in snapshots if s.info.snapshot_id not in handled]
        for older in pending[:-1]:
            self.registry.mark(older.info.snapshot_id, SNAPSHOT_SKIPPED)
            self.metrics.skipped.inc()
            log.info(
                "skipped snapshot (a newer one is pending)", step=older.step, path=str(older.path)
            )
        return pending

    def publish(self, snapshot: Snapshot) -> None:
        """Convert ``snapshot`` into a new version directory and register it."""
        start = time.perf_counter()
        version = self.registry.allocate_version()
        try:
            published = self.convert(snapshot, version)
        except CorruptSnapshot as exc:
            info = snapshot.info
            self.quarantine(snapshot.path, info.snapshot_id, str(exc), info.step, snapshot.dir_id)
            return
        except LayoutError as exc:
            placement = " with publisher.expert_parallel" if self.cfg.expert_parallel else ""
            raise ConfigError(
                f"publisher.tp={self.cfg.tp}{placement} cannot serve the model of "
                f"{snapshot.path}: {exc}"
            ) from None
        self.upload(version, published)
        outcome, lag = self.register(version, snapshot, published)
        if outcome != REGISTERED:
            why = "already handled" if outcome == ALREADY_HANDLED else "lost the publisher lock"
            log.warning("version not registered; removing it", version=version, reason=why)
            self.remove_version(version)
            return
        seconds = time.perf_counter() - start
        manifest = published.manifest
        if self.options.delta:  # the next version's delta reads this one from memory
            weights = sorted({t.file for t in manifest.tensors})
            size = sum(f.bytes for f in manifest.files if f.name in weights)
            self.warming = warm_base(published.path, weights, size, self.stopping)
        self.metrics.publish_seconds.observe(seconds)
        self.metrics.lag_seconds.observe(lag)
        self.metrics.bytes.inc(manifest.total_bytes)
        self.metrics.versions.labels(published.reader).inc()
        self.metrics.latest.set(version)
        if published.no_delta:
            self.metrics.deltas_dropped.labels(published.no_delta_kind).inc()
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

    def convert(self, snapshot: Snapshot, version: int) -> ConvertedVersion:
        """Write the version here (and its weights files to the store as they are written);
        whatever fails leaves nothing of it in the store."""
        options = self.options
        if options.delta:
            share = auto_wait_share(self.live_nodes())
            options = dataclasses.replace(options, delta_wait_share=share)
        try:
            return convert(snapshot, self.weights_dir, version, options, self.remote)
        except BaseException:
            if self.remote is not None:
                with contextlib.suppress(WeightcastError):
                    self.remote.remove_version(version_dir_name(version))
            raise

    def live_nodes(self) -> int:
        """The nodes that report to the registry (stale ones are pruned by housekeeping);
        0 when Redis cannot say now (the publish goes on: this only sizes a budget)."""
        try:
            return int(self.redis.hlen(self.keys.nodes))
        except redis.RedisError as exc:
            log.warning("live nodes unknown", reason=str(exc))
            return 0

    def upload(self, version: int, published: ConvertedVersion) -> None:
        """Put the rest of the version in the store (nothing to do when the store is the
        weights directory), ``manifest.json`` last. On failure the version is removed, here
        and there, and the snapshot is published again at the next round."""
        if self.remote is None:
            return
        start = time.perf_counter()
        try:
            self.remote.upload_version(
                version_dir_name(version), published.path, published.uploaded
            )
        except BaseException:
            with contextlib.suppress(WeightcastError):
                self.remove_version(version)
            remove_dir(published.path)
            raise
        seconds = time.perf_counter() - start
        self.metrics.upload_seconds.observe(seconds)
        log.info("uploaded version", version=version, store=self.remote.label, seconds=seconds)

    def remove_version(self, version: int) -> None:
        """Remove every file of ``version`` (evicted, or never registered): from the store
        first, then from the weights directory."""
        if self.remote is not None:
            self.remote.remove_version(version_dir_name(version))
        remove_version_files(self.weights_dir, version)

    def trim_version(self, version: int, delta_from: int) -> None:
        """Make ``version`` delta-only: in the store, then in the weights directory."""
        if self.remote is not None:
            self.remote.trim_version(version_dir_name(version), delta_only_names(delta_from))
        trim_version_files(self.weights_dir, version, delta_from)

    def register(
        self, version: int, snapshot: Snapshot, published: ConvertedVersion
    ) -> tuple[int, float]:
        """Register the whole version directory, riding out a Redis outage; (outcome, lag).

        ``path`` (and ``hf_path``) are relative to the weights directory.
        """
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
                if not self.lock.held:
                    self.lock.try_acquire()  # taken back if no one else took it meanwhile
                outcome = self.registry.register(
                    dataclasses.replace(entry, created_at=registered_at), event, self.lock.holder
                )
                return outcome, lag
            except REDIS_DOWN as exc:
                if self.stopping.is_set() or self.cfg.once:
                    raise  # the unregistered directory is removed at the next start
                self.metrics.errors.labels("redis").inc()
                self.stopping.wait(self.outage.failed(exc, f"registering version {version}"))

    def evict(self) -> None:
        """Keep the newest ``keep`` versions, and any a reader leases; older ones on the
        newest's chain of deltas stay delta-only for ``delta_window`` versions."""
        result = self.evictor.run()
        for version in result.evicted:
            self.metrics.evicted.inc()
            log.info("evicted version", version=version)
        for version in result.trimmed:
            self.metrics.trimmed.inc()
            log.info("kept the delta of an evicted version", version=version)
        for version in result.leased:
            self.metrics.lease_waits.inc()
            log.info("eviction waits for a lease", version=version)

    def quarantine(
        self,
        path: Path,
        snapshot_id: str | None,
        reason: str,
        step: int | None = None,
        judged: DirId | None = None,
    ) -> None:
        """Move the snapshot judged unpublishable aside, with its reason, and say so; not the
        one at ``path`` now if the trainer has written that step again since."""
        target = self.checkpoint_dir / QUARANTINE_DIR / f"{path.name}-{int(time.time() * 1000)}"
        target.parent.mkdir(exist_ok=True)
        if not set_aside(path, judged, target):
            log.info("not quarantined: replaced or removed since it was read", path=str(path))
            return
        (target / REASON_FILE).write_text(reason + "\n")
        if snapshot_id:
            self.registry.mark(snapshot_id, SNAPSHOT_QUARANTINED)
        record = QuarantineRecord(reason, step, str(target), round(time.time(), 3))
        self.registry.record_quarantine(snapshot_id or path.name, record)
        self.metrics.quarantined.inc()
        log.error("quarantined snapshot", path=str(path), moved_to=str(target), reason=reason)

    def prune_snapshots(self) -> None:
        """Remove handled snapshots from the checkpoint directory, keeping the newest two."""
        snapshots, _ = complete_snapshots(self.checkpoint_dir)
        handled = self.registry.handled()
        done = [s for s in snapshots if s.info.snapshot_id in handled]
        for snapshot in done[:-KEEP_SNAPSHOTS]:
            discard(snapshot)

    def prune_quarantine(self) -> None:
        """Keep the newest ``keep_quarantined`` quarantined snapshots."""
        directory = self.checkpoint_dir / QUARANTINE_DIR
        if not directory.is_dir():
            return
        entries = sorted(
            (e for e in directory.iterdir() if not e.name.startswith(TRASH_PREFIX)),
            key=lambda e: e.stat().st_mtime,
        )
        for entry in entries[: max(0, len(entries) - self.cfg.keep_quarantined)]:
            remove_dir(entry)

    def prune_records(self) -> None:
        """Bound the Redis records: stale nodes, old snapshot and quarantine records."""
        on_disk = {s.info.snapshot_id for s in complete_snapshots(self.checkpoint_dir)[0]}
        keep = self.cfg.keep_records
        dropped = {
            "nodes": prune_nodes(self.redis, self.keys, self.cfg.node_retention_seconds),
            "snapshot_records": prune_snapshot_records(self.redis, self.keys, keep, on_disk),
            "quarantine_records": prune_quarantine_records(self.redis, self.keys, keep),
        }
        if any(dropped.values()):
            log.info("pruned records", **{k: len(v) for k, v in dropped.items()})

    def clean_weights_dir(self) -> None:
        """Remove what a crash can leave: temp and trash directories, unregistered versions."""
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        removed = sweep(self.weights_dir, (TMP_VERSION_PREFIX, TRASH_PREFIX))
        sweep(self.checkpoint_dir, (TRASH_PREFIX,))
        sweep(self.checkpoint_dir / QUARANTINE_DIR, (TRASH_PREFIX,))
        live = set(self.registry.live_versions())
        deltas = set(self.evictor.delta_versions())
        for entry in self.weights_dir.iterdir():
            version = dir_version(entry.name)
            if version is not None and version not in live | deltas:
                remove_version_files(self.weights_dir, version)
                removed.append(entry.name)
        for version in deltas:  # a crash between the registry's trim and the directory's
            self.trim_version(version, self.registry.delta_from(version))
        if self.remote is not None:
            for name in self.remote.version_names():
                if dir_version(name) not in live | deltas:
                    self.remote.remove_version(name)
                    removed.append(f"{self.remote.label}{name}")
            if unfinished := self.remote.remove_unfinished():
                removed.append(f"{unfinished} unfinished uploads")
        if removed:
            log.info("removed leftovers of an earlier run", entries=",".join(sorted(removed)))

    def upload_live_versions(self) -> None:
        """Put into the store each live version it lacks and the weights directory holds (the
        deployment moved to a new bucket, or the bucket was emptied), under its own number:
        nodes then load it instead of waiting for the next version, which the trainer could
        only train from their rollouts. Only a local copy whose manifest is the registered one
        goes up, and what an interrupted upload of it left is replaced."""
        if self.remote is None:
            return
        for version in self.registry.live_versions():
            name = version_dir_name(version)
            registered = self.registry.manifest_sha256(version)
            if self.stored_manifest_sha256(name) == registered:
                continue
            manifest = self.weights_dir / name / MANIFEST_NAME
            if not manifest.is_file() or sha256_file(manifest) != registered:
                log.warning(
                    "a live version is in neither the store nor the weights directory; "
                    "nodes cannot load it",
                    version=version,
                    store=self.remote.label,
                )
                continue
            self.remote.remove_version(name)
            self.remote.upload_version(name, manifest.parent)
            log.info("uploaded a live version the store lacked", version=version)

    def stored_manifest_sha256(self, name: str) -> str:
        """The SHA-256 of the manifest under ``name`` in the store; empty when it has none."""
        assert self.remote is not None
        try:
            with self.remote.open_version(name) as stored:
                return sha256_bytes(stored.read_small(MANIFEST_NAME, MAX_MANIFEST_BYTES))
        except WeightsError:
            return ""

    def health(self) -> Health:
        """Unhealthy when Redis does not answer, a failure is being retried, or the loop has
        not ticked for a long while."""
        stalled = time.monotonic() - self.last_tick
        failures = self.outage.attempts + self.disk.failures
        detail: dict[str, Any] = {
            "leader": self.lock.held,
            "seconds_since_loop": round(stalled, 1),
            "consecutive_failures": failures,
            "last_error": self.last_error,
        }
        try:
            self._health_redis.ping()
            detail["redis"] = "ok"
        except redis.RedisError as exc:
            detail["redis"] = f"unreachable: {exc}"
        limit = max(120.0, 10 * self.cfg.rescan_seconds, 4 * self.cfg.retry_max_seconds)
        ok = detail["redis"] == "ok" and stalled < limit and failures == 0
        return Health(ok, detail)

    def _recovered(self) -> None:
        if self.disk.failures:
            log.info("filesystem recovered", after_failures=self.disk.failures)
        self.outage.recovered()
        self.disk.reset()
        self.last_error = ""

    def _store_failed(self, exc: StoreUnavailable | StoreFull) -> float:
        """Count a store failure (down past store_retry_seconds, or full); the back-off."""
        kind = "store_full" if isinstance(exc, StoreFull) else "store"
        self.metrics.errors.labels(kind).inc()
        delay = self.disk.next()
        self.last_error = f"{kind}: {exc}"
        log.error("object store error; retrying", error=str(exc), retry_in=delay)
        return delay

    def _disk_failed(self, exc: OSError) -> float:
        """Count a filesystem failure; the back-off before the next try."""
        self.metrics.errors.labels("disk").inc()
        delay = self.disk.next()
        self.last_error = f"disk: {exc}"
        log.error("filesystem error; retrying", error=exc, retry_in=delay)
        return delay

    def stop(self) -> None:
        """Ask :meth:`run` to return (what SIGTERM and SIGINT do): within ``WAIT_SLICE_S``
        when it waits, after the publish in hand when it publishes."""
        self.stopping.set()

    def close(self) -> None:
        """Release the Redis connections and the store's client and threads."""
        self.redis.close()
        self._health_redis.close()
        if self.remote is not None:
            self.remote.close()


def run_publisher(config: Config) -> int:
    """Run the publisher; 1 when the disk failed outside the retried loop (``--once``, or
    setting up). :class:`NotLeader` and the other errors are the command's to print."""
    publisher = Publisher(config)
    try:
        publisher.run()
    except OSError as exc:
        gave_up = "publisher --once gave up" if config.publisher.once else "publisher gave up"
        log.error(gave_up, reason=str(exc))
        return 1
    finally:
        publisher.close()
    return 0
