"""What the publisher keeps tidy between publishes: versions evicted, snapshots and records
pruned, the store cleaned of what a crashed leader left, bad snapshots quarantined.

Published, skipped and quarantined snapshots are removed from the checkpoint directory except
the newest :data:`KEEP_SNAPSHOTS`; the newest ``keep_quarantined`` quarantined ones are kept
under ``quarantine/``, each with its ``REASON.txt``. Versions are evicted and trimmed by
:class:`~weightcast_publisher.eviction.Evictor`, their files removed from the publisher's
store (:class:`~weightcast.store.base.WritableStore`).
"""

from __future__ import annotations

import time
from pathlib import Path

from weightcast.contract.keys import SNAPSHOT_QUARANTINED
from weightcast.contract.quarantine import QuarantineRecord
from weightcast.contract.version_info import dir_version, version_dir_name
from weightcast.runtime.durable import TRASH_PREFIX, remove_dir, sweep
from weightcast.runtime.logs import get_logger
from weightcast.store.base import LOST, RESTORED
from weightcast_publisher.context import PublisherContext
from weightcast_publisher.eviction import Evictor, delta_only_names
from weightcast_publisher.retention import (
    prune_nodes,
    prune_quarantine_records,
    prune_snapshot_records,
)
from weightcast_publisher.snapshot_scan import DirId, complete_snapshots, discard, set_aside

log = get_logger("publisher")

KEEP_SNAPSHOTS = 2
QUARANTINE_DIR = "quarantine"
REASON_FILE = "REASON.txt"


class Housekeeping:
    """Evicts, prunes, cleans and quarantines for the publisher that holds the lock."""

    def __init__(self, ctx: PublisherContext) -> None:
        self.ctx = ctx
        self.evictor = Evictor(
            ctx.redis,
            ctx.keys,
            self.remove_version,
            self.trim_version,
            ctx.cfg.keep,
            ctx.cfg.delta_window,
        )

    def remove_version(self, version: int) -> None:
        """Remove every file of ``version`` (evicted) from the store."""
        self.ctx.store.remove_version(version_dir_name(version))

    def trim_version(self, version: int, delta_from: int) -> None:
        """Make ``version`` delta-only in the store."""
        self.ctx.store.trim_version(version_dir_name(version), delta_only_names(delta_from))

    def evict(self) -> None:
        """Keep the newest ``keep`` versions, and any a reader leases; older ones on the
        newest's chain of deltas stay delta-only for ``delta_window`` versions."""
        result = self.evictor.run()
        for version in result.evicted:
            self.ctx.metrics.evicted.inc()
            log.info("evicted version", version=version)
        for version in result.trimmed:
            self.ctx.metrics.trimmed.inc()
            log.info("kept the delta of an evicted version", version=version)
        for version in result.leased:
            self.ctx.metrics.lease_waits.inc()
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
        ctx = self.ctx
        target = ctx.checkpoint_dir / QUARANTINE_DIR / f"{path.name}-{int(time.time() * 1000)}"
        target.parent.mkdir(exist_ok=True)
        if not set_aside(path, judged, target):
            log.info("not quarantined: replaced or removed since it was read", path=str(path))
            return
        (target / REASON_FILE).write_text(reason + "\n")
        if snapshot_id:
            ctx.registry.mark(snapshot_id, SNAPSHOT_QUARANTINED)
        record = QuarantineRecord(reason, step, str(target), round(time.time(), 3))
        ctx.registry.record_quarantine(snapshot_id or path.name, record)
        ctx.metrics.quarantined.inc()
        log.error("quarantined snapshot", path=str(path), moved_to=str(target), reason=reason)

    def prune_snapshots(self) -> None:
        """Remove handled snapshots from the checkpoint directory, keeping the newest two."""
        snapshots, _ = complete_snapshots(self.ctx.checkpoint_dir)
        handled = self.ctx.registry.handled()
        done = [s for s in snapshots if s.info.snapshot_id in handled]
        for snapshot in done[:-KEEP_SNAPSHOTS]:
            discard(snapshot)

    def prune_quarantine(self) -> None:
        """Keep the newest ``keep_quarantined`` quarantined snapshots."""
        directory = self.ctx.checkpoint_dir / QUARANTINE_DIR
        if not directory.is_dir():
            return
        entries = sorted(
            (e for e in directory.iterdir() if not e.name.startswith(TRASH_PREFIX)),
            key=lambda e: e.stat().st_mtime,
        )
        for entry in entries[: max(0, len(entries) - self.ctx.cfg.keep_quarantined)]:
            remove_dir(entry)

    def prune_records(self) -> None:
        """Bound the Redis records: stale nodes, old snapshot and quarantine records."""
        ctx = self.ctx
        on_disk = {s.info.snapshot_id for s in complete_snapshots(ctx.checkpoint_dir)[0]}
        keep = ctx.cfg.keep_records
        dropped = {
            "nodes": prune_nodes(ctx.redis, ctx.keys, ctx.cfg.node_retention_seconds),
            "snapshot_records": prune_snapshot_records(ctx.redis, ctx.keys, keep, on_disk),
            "quarantine_records": prune_quarantine_records(ctx.redis, ctx.keys, keep),
        }
        if any(dropped.values()):
            log.info("pruned records", **{k: len(v) for k, v in dropped.items()})

    def clean_weights_dir(self) -> None:
        """Remove what a crash can leave: temp and trash directories, unregistered versions,
        unfinished uploads (in the weights directory and the store)."""
        ctx = self.ctx
        ctx.weights_dir.mkdir(parents=True, exist_ok=True)
        removed = ctx.store.remove_unfinished()
        sweep(ctx.checkpoint_dir, (TRASH_PREFIX,))
        sweep(ctx.checkpoint_dir / QUARANTINE_DIR, (TRASH_PREFIX,))
        live = set(ctx.registry.live_versions())
        deltas = set(self.evictor.delta_versions())
        for name in ctx.store.version_names():
            if dir_version(name) not in live | deltas:
                ctx.store.remove_version(name)
                removed.append(name)
        for version in deltas:  # a crash between the registry's trim and the store's
            self.trim_version(version, ctx.registry.delta_from(version))
        if removed:
            log.info("removed leftovers of an earlier run", entries=",".join(sorted(removed)))

    def restore_live_versions(self) -> None:
        """Put into the store each live version it lacks and the weights directory holds (the
        deployment moved to a new bucket, or the bucket was emptied), under its own number:
        nodes then load it instead of waiting for the next version, which the trainer could
        only train from their rollouts. Only a local copy whose manifest is the registered one
        goes up, and what an interrupted upload of it left is replaced (nothing to do when
        the store is the weights directory)."""
        ctx = self.ctx
        for version in ctx.registry.live_versions():
            name = version_dir_name(version)
            registered = ctx.registry.manifest_sha256(version)
            outcome = ctx.store.restore_version(name, ctx.weights_dir / name, registered)
            if outcome == LOST:
                log.warning(
                    "a live version is in neither the store nor the weights directory; "
                    "nodes cannot load it",
                    version=version,
                    store=ctx.store.label,
                )
            elif outcome == RESTORED:
                log.info("uploaded a live version the store lacked", version=version)
