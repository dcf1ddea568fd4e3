"""The publisher's loop: scan, publish the newest complete snapshot, evict, prune, wait.

A scan runs at start, after every watchdog hint and at least every ``rescan_seconds``.
When several snapshots are pending only the newest is published; the older ones are
recorded as skipped. Published, skipped and quarantined snapshots are removed from the
checkpoint directory except the newest two.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import redis

from publisher.converter import TMP_VERSION_PREFIX, convert
from publisher.eviction import Evictor
from publisher.registry import QUARANTINED, SKIPPED, Registry
from publisher.snapshot_reader import CorruptSnapshot, Snapshot, complete_snapshots
from publisher.watcher import SnapshotWatcher
from shared.config import Config, ConfigError
from shared.durable import TRASH_PREFIX, remove_dir, sweep
from shared.keys import Keys
from shared.layout import LAYOUT_VLLM_FUSED
from shared.logs import get_logger

log = get_logger("publisher")

KEEP_SNAPSHOTS = 2
QUARANTINE_DIR = "quarantine"
_VERSION_DIR = re.compile(r"^v(\d+)$")


class Publisher:
    def __init__(self, config: Config) -> None:
        cfg = config.publisher
        if cfg.tp < 1:
            raise ConfigError(f"publisher.tp must be >= 1, got {cfg.tp}")
        self.cfg = cfg
        self.checkpoint_dir = Path(config.common.checkpoint_dir)
        self.weights_dir = Path(config.common.weights_dir)
        self.keys = Keys(config.common.namespace)
        self.redis = redis.Redis.from_url(config.common.redis_url)
        self.registry = Registry(self.redis, self.keys)
        self.evictor = Evictor(self.redis, self.keys, self.weights_dir, cfg.keep)
        self.stop_requested = False

    def run(self) -> None:
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        self.clean_weights_dir()
        watcher = SnapshotWatcher(self.checkpoint_dir, poll=self.cfg.poll)
        self._install_signal_handlers(watcher)
        watcher.start()
        log.info(
            "publisher started",
            checkpoint_dir=str(self.checkpoint_dir),
            weights_dir=str(self.weights_dir),
            tp=self.cfg.tp,
            keep=self.cfg.keep,
            observer=type(watcher.observer).__name__,
        )
        try:
            while not self.stop_requested:
                self.scan_once()
                if self.cfg.once:
                    break
                watcher.wait(self.cfg.rescan_seconds)
        finally:
            watcher.stop()
        log.info("publisher stopped")

    def scan_once(self) -> None:
        """One pass: publish the newest pending snapshot, then evict and prune."""
        snapshots, broken = complete_snapshots(self.checkpoint_dir)
        for path, reason in broken:
            self.quarantine(path, None, reason)
        handled = self.registry.handled()
        pending = [s for s in snapshots if s.info.snapshot_id not in handled]
        if pending:
            for older in pending[:-1]:
                self.registry.mark(older.info.snapshot_id, SKIPPED)
                log.info(
                    "skipped snapshot (a newer one is pending)",
                    step=older.step,
                    path=str(older.path),
                )
            self.publish(pending[-1])
        result = self.evictor.run()
        for version in result.evicted:
            log.info("evicted version", version=version)
        for version in result.leased:
            log.info("eviction waits for a lease", version=version)
        self.prune_snapshots()

    def publish(self, snapshot: Snapshot) -> None:
        start = time.perf_counter()
        version = self.registry.allocate_version()
        try:
            published = convert(snapshot, self.weights_dir, version, self.cfg.tp)
        except CorruptSnapshot as exc:
            self.quarantine(snapshot.path, snapshot.info.snapshot_id, str(exc))
            return
        registered_at = time.time()
        lag = registered_at - snapshot.info.created_at
        manifest = published.manifest
        fields = {
            "path": str(published.path.resolve()),
            "step": snapshot.step,
            "layout": LAYOUT_VLLM_FUSED,
            "tp": self.cfg.tp,
            "dtype": manifest.dtype,
            "bytes": manifest.total_bytes,
            "created_at": registered_at,
            "manifest_sha256": published.manifest_sha256,
            "run_id": snapshot.info.run_id,
            "snapshot_id": snapshot.info.snapshot_id,
            "snapshot_created_at": snapshot.info.created_at,
        }
        event: dict[str, Any] = {
            "step": snapshot.step,
            "lag_s": round(lag, 4),
            "path": fields["path"],
        }
        if not self.registry.register(version, snapshot.info.snapshot_id, fields, event):
            log.warning(
                "snapshot was already published; dropping the duplicate",
                version=version,
                step=snapshot.step,
            )
            remove_dir(published.path)
            return
        log.info(
            "published version",
            version=version,
            step=snapshot.step,
            bytes=manifest.total_bytes,
            seconds=time.perf_counter() - start,
            lag_s=lag,
        )

    def quarantine(self, path: Path, snapshot_id: str | None, reason: str) -> None:
        """Move a snapshot that cannot be published aside, with its reason."""
        target = self.checkpoint_dir / QUARANTINE_DIR / f"{path.name}-{int(time.time())}"
        target.parent.mkdir(exist_ok=True)
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return
        (target / "REASON.txt").write_text(reason + "\n")
        if snapshot_id:
            self.registry.mark(snapshot_id, QUARANTINED)
        log.error("quarantined snapshot", path=str(path), moved_to=str(target), reason=reason)

    def prune_snapshots(self) -> None:
        """Remove handled snapshots from the checkpoint directory, keeping the newest two."""
        snapshots, _ = complete_snapshots(self.checkpoint_dir)
        handled = self.registry.handled()
        done = [s for s in snapshots if s.info.snapshot_id in handled]
        for snapshot in done[:-KEEP_SNAPSHOTS]:
            remove_dir(snapshot.path)

    def clean_weights_dir(self) -> None:
        """Remove what a crash can leave: temp and trash directories, unregistered versions."""
        removed = sweep(self.weights_dir, (TMP_VERSION_PREFIX, TRASH_PREFIX))
        sweep(self.checkpoint_dir, (TRASH_PREFIX,))
        live = set(self.registry.live_versions())
        for entry in self.weights_dir.iterdir():
            match = _VERSION_DIR.match(entry.name)
            if match and int(match.group(1)) not in live:
                remove_dir(entry)
                removed.append(entry.name)
        if removed:
            log.info("removed leftovers of an earlier run", entries=",".join(sorted(removed)))

    def _install_signal_handlers(self, watcher: SnapshotWatcher) -> None:
        def request_stop(signum: int, _frame: Any) -> None:
            self.stop_requested = True
            watcher.poke()

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)


def run_publisher(config: Config) -> int:
    Publisher(config).run()
    return 0
