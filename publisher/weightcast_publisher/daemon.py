"""The publisher's loop: lead, scan, publish the newest complete snapshot, evict, prune, wait.

Only the holder of the namespace's publisher lock works; a second publisher waits as a
standby and takes over within the lock's TTL when the leader dies. A scan runs at start,
after every watchdog hint and at least every ``rescan_seconds``. When several snapshots are
pending only the newest is published; the older ones are recorded as skipped. A Redis outage
is ridden out for ``redis_retry_seconds`` (:class:`~weightcast.runtime.retry.Outage`), a
failing disk (full, read-only) is retried without end, both with capped exponential back-off:
nothing is registered meanwhile, temp files are removed, ``/healthz`` says 503.

The loop holds one store (:func:`~weightcast.store.factory.publisher_store`: the weights
directory, or that directory mirrored to a bucket) and two parts of one concern each, which
it hands what they share (:class:`~weightcast_publisher.context.PublisherContext`):
:class:`~weightcast_publisher.publishing.Publishing` (one publish: write in the store, finish
there, register) and :class:`~weightcast_publisher.housekeeping.Housekeeping` (evict, prune,
clean what a crash left, quarantine).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from weightcast.contract.errors import StoreFull, StoreUnavailable, WeightcastError
from weightcast.contract.keys import SNAPSHOT_SKIPPED, Keys
from weightcast.contract.snapshot_format import snapshot_step
from weightcast.runtime.config import Config
from weightcast.runtime.logs import get_logger
from weightcast.runtime.observability import Health, serve
from weightcast.runtime.redis_client import redis_client
from weightcast.runtime.retry import REDIS_DOWN, Outage, Retries
from weightcast.runtime.stop import StopRequest
from weightcast.store.factory import publisher_store
from weightcast_publisher.context import PublisherContext
from weightcast_publisher.housekeeping import Housekeeping
from weightcast_publisher.leader import LeaderLock
from weightcast_publisher.metrics import PublisherMetrics
from weightcast_publisher.publishing import Publishing, convert_options
from weightcast_publisher.registry import Registry
from weightcast_publisher.snapshot_scan import CorruptSnapshot, Snapshot, complete_snapshots
from weightcast_publisher.watcher import SnapshotWatcher

log = get_logger("publisher")


class NotLeader(WeightcastError):
    """``--once`` found another publisher holding the lock."""


class Publisher:
    """The loop: leadership, the scan for snapshots, health; one publish and the housekeeping
    after it are :attr:`publishing`'s and :attr:`housekeeping`'s."""

    def __init__(self, config: Config) -> None:
        cfg = config.publisher
        self.cfg = cfg
        options = convert_options(cfg)
        self.checkpoint_dir = Path(config.common.checkpoint_dir)
        self.weights_dir = Path(config.common.weights_dir)
        location = config.common.weights_location() if config.common.weights_url else ""
        self.store = publisher_store(self.weights_dir, location, config.common.store_retry_seconds)
        self.keys = Keys(config.common.namespace)
        self.redis = redis_client(config.common.redis_url)
        self.registry = Registry(self.redis, self.keys)
        self.lock = LeaderLock(self.redis, self.keys, cfg.leader_ttl_seconds)
        self.metrics = PublisherMetrics()
        self.stopping = StopRequest()
        self.outage = Outage(budget=config.common.redis_retry_seconds, cap=cfg.retry_max_seconds)
        self.disk = Retries(cap=cfg.retry_max_seconds)
        """The back-off of a failing disk (full, read-only) or store (down, full), retried
        without end."""
        self.ctx = PublisherContext(
            cfg=cfg,
            checkpoint_dir=self.checkpoint_dir,
            weights_dir=self.weights_dir,
            store=self.store,
            redis=self.redis,
            keys=self.keys,
            registry=self.registry,
            lock=self.lock,
            metrics=self.metrics,
            outage=self.outage,
            stopping=self.stopping,
        )
        """What :attr:`publishing` and :attr:`housekeeping` share with the loop."""
        self.publishing = Publishing(self.ctx, options)
        self.housekeeping = Housekeeping(self.ctx)
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
            self.store.check()  # a missing bucket or a refused credential: exit 2 now
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
            store=self.store.label,
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
            self.housekeeping.clean_weights_dir()
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
            self.housekeeping.restore_live_versions()
            self.live_versions_stored = True
        pending = self.pending_snapshots()
        if pending:
            self.publish(pending[-1])
        self.housekeeping.evict()
        self.housekeeping.prune_snapshots()
        self.housekeeping.prune_quarantine()
        self.housekeeping.prune_records()

    def pending_snapshots(self) -> list[Snapshot]:
        """Complete snapshots not yet handled, oldest first; the broken ones quarantined and
        all but the newest recorded as skipped."""
        snapshots, broken = complete_snapshots(self.checkpoint_dir)
        for bad in broken:
            step = snapshot_step(bad.path.name)
            self.housekeeping.quarantine(bad.path, None, bad.reason, step, bad.dir_id)
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
        """Publish ``snapshot`` as the next version; quarantine it when it cannot be."""
        try:
            self.publishing.publish(snapshot)
        except CorruptSnapshot as exc:
            info = snapshot.info
            self.housekeeping.quarantine(
                snapshot.path, info.snapshot_id, str(exc), info.step, snapshot.dir_id
            )

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
        delay = self.disk.failed()
        self.last_error = f"{kind}: {exc}"
        log.error("object store error; retrying", error=str(exc), retry_in=delay)
        return delay

    def _disk_failed(self, exc: OSError) -> float:
        """Count a filesystem failure; the back-off before the next try."""
        self.metrics.errors.labels("disk").inc()
        delay = self.disk.failed()
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
        self.store.close()


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
