"""Keeping the publisher's Redis records bounded: nodes that stopped reporting, and the
snapshot and quarantine records beyond the newest ``publisher.keep_records``.

``{wc}:weights:snapshots`` holds no time, so :attr:`Keys.snapshot_order` records when each
record was first seen here (one scan after it was written, or at the first scan after an
upgrade); the oldest go first. A record whose snapshot is still in the checkpoint directory
is never dropped: that snapshot would be published again.
"""

from __future__ import annotations

import time
from collections.abc import Set

import redis

from weightcast.contract.keys import Keys
from weightcast.contract.nodes import NodeReport
from weightcast.contract.quarantine import QuarantineRecord


def prune_nodes(client: redis.Redis, keys: Keys, retention_s: float) -> list[str]:
    """Drop the nodes that have not reported for ``retention_s`` (and unreadable records);
    the ids dropped."""
    cutoff = time.time() - retention_s
    gone = []
    for node, value in client.hgetall(keys.nodes).items():
        try:
            stale = NodeReport.parse(value).at < cutoff
        except ValueError:
            stale = True
        if stale:
            gone.append(node)
    if gone:
        client.hdel(keys.nodes, *gone)
    return [node.decode(errors="replace") for node in gone]


def prune_snapshot_records(
    client: redis.Redis, keys: Keys, keep: int, on_disk: Set[str]
) -> list[str]:
    """Keep the newest ``keep`` records of handled snapshots (and those of ``on_disk``
    snapshot ids); the snapshot ids dropped."""
    records = set(client.hkeys(keys.snapshots))
    seen = dict(client.zrange(keys.snapshot_order, 0, -1, withscores=True))
    new = {record: time.time() for record in records - seen.keys()}
    if new:
        client.zadd(keys.snapshot_order, new, nx=True)
    orphans = seen.keys() - records
    ordered = sorted({**seen, **new}.items(), key=lambda item: item[1])
    old = [record for record, _ in ordered[: max(0, len(ordered) - keep)]]
    gone = [record for record in old if record in records and record.decode() not in on_disk]
    if gone:
        client.hdel(keys.snapshots, *gone)
    if gone or orphans:
        client.zrem(keys.snapshot_order, *gone, *orphans)
    return [record.decode() for record in gone]


def prune_quarantine_records(client: redis.Redis, keys: Keys, keep: int) -> list[str]:
    """Keep the newest ``keep`` quarantine records (unreadable ones count as oldest); the
    names dropped."""
    entries = []
    for name, value in client.hgetall(keys.quarantine).items():
        try:
            at = QuarantineRecord.parse(value).at
        except ValueError:
            at = 0.0
        entries.append((at, name))
    entries.sort()
    gone = [name for _, name in entries[: max(0, len(entries) - keep)]]
    if gone:
        client.hdel(keys.quarantine, *gone)
    return [name.decode(errors="replace") for name in gone]
